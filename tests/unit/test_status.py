from __future__ import annotations

from sitsmesh.status import ServiceState, Serving, StatusBoard


def test_board_tracks_states_and_tells_listeners() -> None:
    now = [100.0]
    board = StatusBoard(clock=lambda: 1_000.0, monotonic=lambda: now[0])
    seen: list[tuple[str, Serving]] = []
    board.register("", "data")
    board.add_listener(lambda s: seen.append((s.name, s.state)))
    assert seen == [("", Serving.NOT_SERVING)], "a new listener hears the current state"
    board.register("svc.A", "data")
    board.register("admin.Admin", "admin")
    board.set_all(Serving.SERVING)
    board.set_all(Serving.DRAINING, server="admin")
    assert {(s.name, s.state) for s in board.services()} == {
        ("", Serving.SERVING), ("svc.A", Serving.SERVING), ("admin.Admin", Serving.DRAINING)}
    assert seen[-1] == ("admin.Admin", Serving.DRAINING)
    now[0] = 112.5
    assert board.uptime() == 12.5
    assert board.started_at == 1_000.0
    assert isinstance(board.services()[0], ServiceState)
