"""The failure classifier on real Ray 2.60 Train V2 texts (captured on this machine, see ray_messages/).

- oom_memory_monitor.txt: ``str()`` of the ``ray.exceptions.OutOfMemoryError`` that
  ``TorchTrainer.fit()`` raised when Ray's memory monitor (``RAY_memory_usage_threshold=0.1``)
  killed the controller and both workers of a 2-worker run;
- worker_process_died.txt: ``str()`` of the ``WorkerGroupError`` after rank 0 called ``os._exit``
  (the same text as after ``kill -9``);
- user_exception.txt: ``str()`` of the ``WorkerGroupError`` after rank 1 raised a ValueError;
- oom_train_queue_actor.txt: the traceback ``prvrlab train`` (2 workers) got when the memory monitor
  (``RAY_memory_usage_threshold`` just above the machine's use) killed the driver's report queue actor.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prvrlab.platform.failures import (
    STUDY_HINT,
    TRAIN_HINT,
    carries_interrupt,
    explain_exception,
    explain_failure,
    failure_text,
    interrupts_unwrapped,
    record_failure,
)

MESSAGES = Path(__file__).parent / "ray_messages"


def message(name: str) -> str:
    return (MESSAGES / name).read_text()


def test_memory_monitor_kill_is_said_plainly_with_the_usage_from_its_first_line():
    text = message("oom_memory_monitor.txt")
    used, limit = re.search(r"was ([\d.]+)GB used / ([\d.]+)GB limit", text).groups()
    killed = [ln.split("task name=")[1].split(".")[0].split(":")[0] for ln in text.splitlines() if ln.startswith("Selected to kill")]
    assert sorted(killed) == sorted(["RayTrainWorker", "RayTrainWorker", "TrainController", "AutoscalingCoordinator",
                                     "SynchronizationActor", "PlacementGroupCleaner"])
    failure = explain_failure(text)
    assert failure.kind == "out_of_memory" and failure.retryable
    assert failure.summary == (
        "2 training workers, Ray Train's controller and 3 Ray helpers killed: "
        f"out of memory, {float(used):.1f} of {float(limit):.1f} GiB in use; {TRAIN_HINT}"
    )
    assert ", 2.4 of 23.5 GiB in use" in failure.summary
    # what the old driver kept (the last 8 lines) says neither what was killed nor the usage
    tail = "\n".join([ln for ln in text.splitlines() if ln.strip()][-8:])
    assert "GB used" not in tail and "were killed" not in tail


def test_one_killed_worker_reads_as_the_issue_asks():
    lines = message("oom_memory_monitor.txt").splitlines()
    worker = next(i for i, ln in enumerate(lines) if ln.startswith("Selected to kill") and "RayTrainWorker" in ln)
    one = [ln for i, ln in enumerate(lines) if not ln.startswith("Selected to kill") or i == worker]
    assert explain_failure("\n".join(one)).summary == f"worker killed: out of memory, 2.4 of 23.5 GiB in use; {TRAIN_HINT}"


def test_a_killed_helper_is_named_and_retried():
    failure = explain_failure(message("oom_train_queue_actor.txt"))
    assert failure.retryable and failure.summary.startswith("a Ray helper (_QueueActor) killed: out of memory, 12.6 of 23.5 GiB")


def test_the_hint_names_the_keys_of_the_caller():
    failure = explain_failure(message("oom_memory_monitor.txt"), hint=STUDY_HINT)
    assert failure.summary.endswith("; lower train.batch_size, resources.workers_per_trial or concurrency")


def test_dead_worker_process_is_retryable_and_names_rank_and_pid():
    text = message("worker_process_died.txt")
    pid = re.search(r"\bpid: (\d+)", text).group(1)
    failure = explain_failure(text)
    assert failure.kind == "worker_died" and failure.retryable
    assert failure.summary.startswith(f"worker died: worker rank 0 (pid {pid}) exited unexpectedly")
    assert "connection error code 2" in failure.summary


def test_exception_in_the_training_code_is_not_retried_and_keeps_its_message():
    failure = explain_failure(message("user_exception.txt"))
    assert failure == type(failure)(
        "error",
        "error in the training code (worker rank 1): ValueError: batch of 0 videos: train.batch_size must be >= 1",
        False,
    )


def test_lost_node_is_retryable():
    # the ActorDiedError text Ray's GCS writes when the actor's node died (gcs_server string)
    text = "The actor died unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker\nThe actor died because its node has died. Node Id: 5ba38ef5"
    failure = explain_failure(text)
    assert failure.kind == "node_lost" and failure.retryable


def test_gpu_out_of_memory_in_the_step_is_not_retried():
    text = "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    failure = explain_failure(text)
    assert failure.kind == "gpu_out_of_memory" and not failure.retryable
    assert TRAIN_HINT in failure.summary


def test_a_raised_exception_is_explained_from_its_full_text():
    def innermost():
        raise KeyError("video v_17 has no features")

    try:
        try:
            innermost()
        except KeyError as exc:
            raise RuntimeError("reading the batch failed") from exc
    except RuntimeError as exc:
        text = failure_text(exc)
        failure = explain_exception(exc)
    assert "innermost" in text and "KeyError" in text  # the traceback and the cause are kept
    assert failure.summary == "error in the training code: RuntimeError: reading the batch failed"
    assert not failure.retryable


def test_record_failure_appends_every_attempt_with_the_full_text(tmp_path):
    path = tmp_path / "files" / "error.txt"
    oom, died = message("oom_memory_monitor.txt"), message("worker_process_died.txt")
    record_failure(path, oom, explain_failure(oom), attempt=1)
    record_failure(path, died, explain_failure(died), attempt=2)
    written = path.read_text()
    assert written.count("=== attempt ") == 2
    assert oom.strip() in written and died.strip() in written
    assert written.index("=== attempt 1: 2 training workers") < written.index("=== attempt 2: worker died")


@pytest.mark.parametrize("name", ["oom_memory_monitor.txt", "worker_process_died.txt", "user_exception.txt"])
def test_every_summary_is_one_line(name):
    assert "\n" not in explain_failure(message(name)).summary


def test_a_trials_last_failure_is_read_from_its_tune_error_file(tmp_path):
    from types import SimpleNamespace

    from prvrlab.platform.search.outcome import trial_error

    died, raised = message("worker_process_died.txt"), message("user_exception.txt")
    error_file = tmp_path / "error.txt"  # as Tune appends it: "Failure # n (occurred at ...)" then the error
    error_file.write_text(f"Failure # 1 (occurred at 2026-11-23_18-23-04)\n{died}\nFailure # 2 (occurred at 2026-11-23_18-24-10)\n{raised}\n")
    text, failure = trial_error(SimpleNamespace(error_file=str(error_file), get_error=lambda: None))
    assert text.strip() == raised.strip()
    assert failure.kind == "error" and failure.summary.endswith("ValueError: batch of 0 videos: train.batch_size must be >= 1")
    assert trial_error(SimpleNamespace(error_file=None, get_error=lambda: None))[1].summary == "trial failed (no error text recorded)"


def test_the_origin_of_a_plain_error_is_named():
    text = "Traceback (most recent call last):\n  File \"driver.py\", line 3, in train\nOSError: [Errno 28] No space left on device"
    failure = explain_failure(text, origin="the driver")
    assert failure.summary == "error in the driver: OSError: [Errno 28] No space left on device" and not failure.retryable


class _StopsWhenNamed:
    """A descriptor whose ``__set_name__`` is interrupted, as a SIGTERM can interrupt a lazy import."""

    def __set_name__(self, owner, name):
        raise KeyboardInterrupt


def _class_creation_interrupted() -> BaseException:
    try:
        type("LiteralExpr", (), {"data_type": _StopsWhenNamed()})
    except BaseException as exc:  # Python 3.11: RuntimeError from the interrupt; 3.12+: the interrupt itself
        return exc
    raise AssertionError("creating the class did not raise")


def test_an_interrupt_is_found_through_causes_and_contexts_and_only_there():
    wrapped = _class_creation_interrupted()
    assert carries_interrupt(wrapped)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ValueError("raised while handling it")  # context, not cause
    except ValueError as exc:
        assert carries_interrupt(exc)
    loop = RuntimeError("a")
    loop.__context__ = ValueError("b")
    loop.__context__.__context__ = loop
    assert not carries_interrupt(loop)
    assert not carries_interrupt(RuntimeError("Error calling __set_name__ on 'Field'"))


def test_interrupts_unwrapped_reraises_a_wrapped_interrupt_as_one_and_leaves_other_errors():
    with pytest.raises(KeyboardInterrupt) as info:
        with interrupts_unwrapped():
            raise RuntimeError("Error calling __set_name__") from KeyboardInterrupt()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="plain"):
        with interrupts_unwrapped():
            raise ValueError("plain")
