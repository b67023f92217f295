"""Helpers the whole suite shares. tests/ has no packages of its own: tests/conftest.py puts
tests/ on the path, so these import as ``support.<module>`` from any test or helper.

- `waiting`: the one bounded wait (`wait_for`, and `wait_for_value` for a probe and its test);
- `fake_controller`: the daemon's agent endpoint as an agent sees it (FakeController).

A fake here has a contract test that runs the same assertions against the fake and against
its real counterpart: tests/integration/test_daemon_contract.py for FakeController.
"""
