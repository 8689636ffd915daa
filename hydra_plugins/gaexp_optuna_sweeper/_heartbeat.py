"""A sweep's heartbeat: while its trials run, a thread records that their sweep is alive (Optuna's own heartbeat
in an RDB storage, a system attribute in a journal); the next sweep that opens a study fails the RUNNING trials
whose beats stopped (a killed sweep's), never a live sweep's. Private, so Hydra's plugin scan does not import
Optuna in every application."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List

import optuna
from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled
from optuna.trial import TrialState

from hydra_plugins.gaexp_optuna_sweeper.config import HEARTBEAT

log = logging.getLogger(__name__)


def has_heartbeat(storage: optuna.storages.BaseStorage) -> bool:
    """Whether the storage keeps Optuna's own heartbeat (an RDB storage given an interval); a journal has none."""
    return isinstance(storage, BaseHeartbeat) and is_heartbeat_enabled(storage)


def beat(storage: optuna.storages.BaseStorage, trial_id: int) -> None:
    """Record that the sweep running a trial is alive: Optuna's heartbeat (RDB), or a system attribute."""
    if has_heartbeat(storage):
        storage.record_heartbeat(trial_id)
    else:
        storage.set_trial_system_attr(trial_id, HEARTBEAT, time.time())


def fail_stale_trials(study: optuna.Study, grace_period: float, callback: Any) -> List[int]:
    """Fail the RUNNING trials whose sweep stopped beating `grace_period` seconds ago (a killed sweep's),
    then call `callback(study, trial)` for each; a live sweep's trials beat and are left alone. A trial that
    never beat (recorded by an older gaexp) counts from its start. Returns the failed trials' numbers."""
    storage = study._storage
    running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    if has_heartbeat(storage):
        optuna.storages.fail_stale_trials(study)  # Optuna's own, with the storage's callback
        return sorted(t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                      if t.number in running)
    now, failed = time.time(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        last = trial.system_attrs.get(HEARTBEAT, trial.datetime_start.timestamp() if trial.datetime_start else now)
        if now - last <= grace_period:
            continue
        try:
            if not storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:  # its sweep told it meanwhile
            continue
        failed.append(trial.number)
        if callback is not None:
            callback(study, storage.get_trial(trial._trial_id))
    return failed


class Heartbeat:
    """While a sweep's trials run: a thread recording a beat for each of them every `interval` seconds."""

    def __init__(self, storage: optuna.storages.BaseStorage, interval: float) -> None:
        self.storage, self.interval, self.trials = storage, interval, set()
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self.run, name="gaexp-optuna-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopped.set()
        self.thread.join()

    def add(self, trial_id: int) -> None:
        with self.lock:
            self.trials.add(trial_id)
            beat(self.storage, trial_id)

    def remove(self, trial_id: int) -> None:
        with self.lock:
            self.trials.discard(trial_id)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            with self.lock:
                for trial_id in list(self.trials):
                    try:
                        beat(self.storage, trial_id)
                    except Exception as e:  # noqa: BLE001 - a missed beat is retried at the next one
                        log.warning("heartbeat of trial id %d: %s", trial_id, e)
