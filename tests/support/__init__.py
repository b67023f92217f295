"""Helpers the whole suite shares. tests/ has no packages of its own: tests/conftest.py puts
tests/ on the path, so these import as ``support.<module>`` from any test or helper.

- `waiting`: the one bounded wait (`wait_for`, and `wait_for_value` for a probe and its test);
- `fake_controller`: the daemon's agent endpoint as an agent sees it (FakeController);
- `fake_nvml`: the subset of pynvml the NVML source calls (FakeNvml over FakeGpu), fed with
  the recording of pynvml's codes, constants and structs (tests/fixtures/nvml/);
- `slurm_recordings`: recorded real Slurm output (tests/fixtures/slurm/) and the runners that
  replay it with the argv checked.

A fake here has a contract test that runs the same assertions against the fake and against
its real counterpart: tests/integration/test_daemon_contract.py for FakeController,
tests/unit/gpu/test_nvml_contract.py for FakeNvml (its real half marked `gpu`),
tests/integration/slurm/test_slurm_contract.py for the recorded Slurm output (its real half
marked `slurm`).
"""
