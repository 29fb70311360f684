from sitsmesh.cli import main

raise SystemExit(main())
