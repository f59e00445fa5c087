"""The worker the settings ask for: the worker core over the model (gpu_worker/worker.py), or over a simulated device
(`settings.simulate`, gpu_worker/simulated.py). Both modules know the core; only this one knows both."""
from __future__ import annotations

from gpu_worker import simulated
from gpu_worker.worker import Worker
from shared.settings import Settings


def make_worker(settings: Settings, worker_id: str = "worker-0", progress: bool = True) -> Worker:
    if settings.simulate:
        return simulated.load(settings, worker_id)
    return Worker.load(settings, worker_id, progress)
