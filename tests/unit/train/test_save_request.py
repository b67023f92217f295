from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from slurmft.train.save_request import SaveRequest


def test_a_signal_requests_a_save_until_cleared() -> None:
    request = SaveRequest(request_file="", signum=signal.SIGUSR1)
    try:
        assert not request.pending()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.pending()
        request.clear()
        assert not request.pending()
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_touching_the_request_file_requests_one_save(tmp_path: Path) -> None:
    path = tmp_path / "save-request"
    path.touch()
    os.utime(path, (time.time() - 60, time.time() - 60))  # a request older than the process
    request = SaveRequest(request_file=str(path), signum=None)
    assert not request.pending()
    os.utime(path)  # the agent touches it
    assert request.pending()
    request.clear()
    assert not request.pending()
