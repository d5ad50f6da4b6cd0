"""Elastic training (``horovodrun --min-np/--max-np --host-discovery-script``): the replica layer's
:mod:`hvrep.replica.elastic`, re-exported."""

from hvrep.replica.elastic import FAILURE, HOSTS_ADDED, HOSTS_REMOVED, Reset, State, lost_worker, run

__all__ = ["FAILURE", "HOSTS_ADDED", "HOSTS_REMOVED", "Reset", "State", "lost_worker", "run"]
