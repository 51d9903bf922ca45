"""The typed contracts between ranks and with the user: reports on the wire, the summary's keys."""

import re
from pathlib import Path

import pytest

from mpitrain.core.reports import SUMMARY_KEYS, ShardReport, WorkerReport, from_bytes, to_bytes

README = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"  # "Reading the output"


def test_every_summary_key_is_documented_in_the_readme():
    """Getting started's --summary-json paragraph names each field of reports.Summary, and nothing else
    in backticks there looks like a key that does not exist."""
    text = README.read_text()
    start = text.index("`--summary-json PATH` writes")
    end = text.find("\n\n", start)
    paragraph = text[start:end if end > 0 else None]  # the page may end with it
    named = set(re.findall(r"`([a-z][a-z0-9_]*)`", paragraph))
    missing = [k for k in SUMMARY_KEYS if k not in named]
    assert not missing, f"summary keys not in the README: {missing}"
    # words in backticks that are not keys are the nested fields the paragraph explains
    nested = {"origin", "batches_in_flight", "batches_repeated", "mean", "p50", "p99", "max", "why", "count", "first", "newest_checkpoint", "seconds", "training_seconds",
              "test_accuracy", "test_loss", "sent", "received", "successor", "ranks", "updates_lost_at_most", "servers", "lost_shards",
              "state_kept", "state_restarted", "workers_left_out",
              "epoch", "complete", "samples", "missed", "repeated", "dropped", "partial", "left", "compute"}
    assert named - set(SUMMARY_KEYS) <= nested, named - set(SUMMARY_KEYS) - nested


@pytest.mark.parametrize("report", [
    WorkerReport(2, 10, 1, None, 9, 0.5, 0.9, "abc", {"compute": 0.5}, {"median_s": 0.01}, [1.0, 2.0],
                 [{"name": "compute", "ts": 1}]),
    ShardReport(1, "host", 1, 3755, 0.3, 100, 10, 20, {"mean": 0.0}, {"global_step": 5, "why": "x"},
                stop_signal=15, stop_origin="SIGTERM received"),
])
def test_a_report_survives_the_wire_with_its_kind_and_values(report):
    back = from_bytes(bytearray(to_bytes(report)))
    assert type(back) is type(report) and back == report


def test_one_process_summary_has_no_per_worker_words():
    """One process has no workers to tell apart and drops nothing: its summary used to say
    'per worker [...] | dropped gradients 0', '(rank 0)' and '0 bytes through MPI per sample'."""
    from conftest import run_mpitrain

    proc = run_mpitrain(0, "--steps", "50", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    for words in ("per worker", "dropped gradients", "(rank 0)", "worker steps", "through MPI"):
        assert words not in proc.stdout, proc.stdout
    assert "test accuracy" in proc.stdout and "final train loss" in proc.stdout


def test_a_summary_of_nothing_trained_with_dropped_gradients_prints(tmp_path):
    """A take-over at the budget (--on-lost-server continue) leaves a phase that trained nothing, whose
    --quorum workers still report the gradients they dropped earlier: the straggler line formatted
    steps_per_second, None there, and the successor's summary died in a traceback (chaos, Open MPI)."""
    from conftest import train

    from mpitrain.duties.metrics import human_summary

    s = train(0, tmp_path, "--steps", "20")
    s.update(trained=False, steps_per_second=None, samples_per_second=None, dropped_gradients=3, mode="sync",
             quorum=2, workers=3, failovers=[{"successor": 1}])
    text = "\n".join(human_summary(s))
    assert "the successor saved and evaluated it" in text and "straggler effect" not in text


def test_a_stop_is_named_where_it_began_not_where_it_was_passed_on():
    """Every rank records what asked it to stop first (core/stop.StopRequest.origin); the summary names
    the rank that knew it at first hand, before one that took it from the sync workers' vote, before a
    peer's word: a stop whose signal no rank knows reads as SIGTERM (exit 143), so the origin is the
    only way to tell a user's signal from a vote no worker cast (test_chaos[sync], CI 2026-12-07)."""
    from mpitrain.core.stop import StopRequest
    from mpitrain.duties.summary import stop_origin

    def worker(rank, origin):
        return WorkerReport(rank, 1, 0, None, 1, 0.5, 0.9, "d", {}, {}, stop_origin=origin)

    heard, voted, signalled = StopRequest(), StopRequest(), StopRequest()
    heard.heard(-1, 2)  # a stop of unknown signal in rank 2's header
    heard.request(15, "ignored: only the first origin counts")
    voted.request(origin="the workers' stop vote (1 of 2) in the sum of update 9")
    signalled.request(15)
    assert (heard.origin, heard.signum) == ("heard from rank 2", 15) and signalled.origin == "SIGTERM received"
    reports = [worker(2, voted.origin), worker(3, signalled.origin)]
    assert stop_origin(heard.origin, reports) == "rank 3: SIGTERM received"
    assert stop_origin(heard.origin, [worker(1, heard.origin), worker(2, voted.origin)]) == f"rank 2: {voted.origin}"
    assert stop_origin(heard.origin, [worker(1, "")]) == "rank 0: heard from rank 2"
    heard.reset()
    assert heard.origin == "" and stop_origin("", []) == "rank 0: not known"
