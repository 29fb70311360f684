"""Token streams: the events of streaming responses, the tokens in them and their timing
(pure: no I/O; the ext_proc transport feeds them)."""
