"""Helpers the whole suite shares. tests/ has no packages of its own: tests/conftest.py puts
tests/ on the path, so these import as ``support.<module>`` from any test or helper.

- `waiting`: the one bounded wait (`wait_for`, and `wait_for_value` for a probe and its test).
"""
