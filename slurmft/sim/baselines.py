"""The strategies slurmft is compared with, as plain world behaviour (no policy of slurmft's).

- Requeue only: every interruption ends the job and Slurm requeues it (or the site's automation
  resubmits it). A crash ends it at once; a silent node when Slurm calls it lost
  (SlurmdTimeout) or the collective times out (NCCL's timeout), whichever comes first; a hang
  when the collective times out. The site's health check keeps broken nodes out of the next
  attempt. Spares are idle nodes; stragglers go unnoticed.
- In-job restart (NVIDIA's resiliency extension's kind): software faults and hangs (caught by
  its heartbeat deadline) restart the workers in place; a hardware fault needs another node,
  which an in-job restart cannot get, so the job is requeued once the restarter sees it
  (a GPU fault at the GPU check's report, a silent node at the restarter's own dead-peer
  timeout).
"""

from __future__ import annotations

from slurmft.sim.engine import JobState, Simulation


class RequeueOnly:
    def start(self, sim: Simulation) -> None:
        self.sim = sim

    def attempt_started(self, t: float) -> None:
        pass

    def _requeue_after(self, t: float, delay_s: float, blame: str) -> None:
        self.sim.at(t + delay_s, self._requeue, self.sim.job.id, blame)

    def _requeue(self, job_id: str, blame: str) -> None:
        if self.sim.job.id == job_id and self.sim.job.state is not JobState.ENDED:
            self.sim.requeue(self.sim.now, blame)

    def _lost_node_detected_s(self) -> float:
        i = self.sim.inputs
        return min(i.nccl_timeout_s, i.slurmd_timeout_s)

    def software(self, t: float, node: str) -> None:
        self.sim.block(t, "software")
        self._requeue_after(t, 0.0, "software")

    def hang(self, t: float) -> None:
        self._requeue_after(t, self.sim.inputs.nccl_timeout_s, "hang")

    def gpu_fault(self, t: float, node: str, member: bool) -> None:
        if member:
            self._requeue_after(t, 0.0, "gpu")  # its workers crash: the job fails at once

    def nodes_lost(self, t: float, members: list[str], others: list[str]) -> None:
        if members:
            self._requeue_after(t, self._lost_node_detected_s(), "node")

    def straggler(self, t: float, node: str) -> None:
        pass

    def round_ended(self, t: float, key: str) -> None:
        pass

    def round_done(self, t: float, key: str) -> None:
        pass

    def checkpoint(self, t: float, step: int) -> None:
        pass

    def repaired(self, t: float, node: str) -> None:
        pass


class InJobRestart(RequeueOnly):
    def software(self, t: float, node: str) -> None:
        self.sim.restart_round(t, self.sim.inputs.restart_in_place_s, "software")

    def hang(self, t: float) -> None:
        self.sim.at(t + self.sim.inputs.hang_deadline_s, self._hang_caught, self.sim.job.id)

    def _hang_caught(self, job_id: str) -> None:
        if self.sim.job.id == job_id and self.sim.job.state is JobState.HUNG:
            self.sim.restart_round(self.sim.now, self.sim.inputs.restart_in_place_s, "hang")

    def gpu_fault(self, t: float, node: str, member: bool) -> None:
        if member:
            self._requeue_after(t, self.sim.inputs.gpu_report_s, "gpu")

    def nodes_lost(self, t: float, members: list[str], others: list[str]) -> None:
        if members:
            self._requeue_after(t, self.sim.inputs.dead_peer_s, "node")
