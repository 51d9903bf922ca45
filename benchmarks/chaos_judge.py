"""What docs/lost-ranks.md promises for each chaos case (benchmarks/chaos_cases.py), judged from a trial's
output, summary and checkpoints: `expected` returns the broken promises, [] when every one held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from chaos_cases import EXIT_PEER_LOST, NP, RANK0_KILLED, STUCK_EXITS, Case, Trial, command, failover, goes_on
from support import IMPL, STUCK_LINE, ExitCode, checkpoint, env


def ledger_problems(summary: dict | None, batch: int = 100) -> list[str]:
    """Issue 81's promise: every epoch dealt whole applied each of its batches once (the summary's `epochs`,
    every mode's: --quorum's left-out batches are `dropped`, not missed), but those dealt again though applied:
    by an async take-over of rank 0 (its copy had applied them), or after a worker lost inside its apply to the
    shm store; as many as their records count (`batches_repeated` of a take-over, of a lost worker; the cases'
    batch is the default 100). A batch trained twice takes a step of --steps: as many of the last batches dealt
    are then out when the run stops, missed in the last complete epochs (a resume deals them again)."""
    s = summary or {}
    epochs, records = s.get("epochs") or [], [*(s.get("failovers") or []), *(s.get("lost_workers") or [])]
    repeated, said = sum(e["repeated"] for e in epochs), sum(r.get("batches_repeated", 0) for r in records) * batch
    complete = [e for e in epochs if e["complete"]]
    bad = [e["epoch"] for e in complete if e["missed"]]
    last = {e["epoch"] for e in complete[-2:]}
    budget = sum(e["missed"] for e in complete) <= repeated and set(bad) <= last
    problems = [f"{len(bad)} complete epoch(s) missed samples (first: epoch {bad[0]})"] if bad and not budget else []
    if repeated != said:
        problems.append(f"the epochs count {repeated} samples trained twice, the take-overs and losses {said}")
    return problems


def expected(case: Case, trial: Trial, err: str, code: int, summary: dict | None, tmp: Path,
             joiner: str = "", out: str = "") -> list[str]:
    """What docs/lost-ranks.md promises for this case; [] when it held. `err` is the job's
    standard error, `out` its standard output (rank 0's lines about joins and replacements)."""
    v = trial.victim
    if v is None:  # the kill came after the victim had exited: an ordinary finished run
        return [] if code == 0 and summary and summary["global_step"] == case.steps else [f"exit {code} with no kill"]
    ck = checkpoint.list_checkpoints(tmp / "ck")
    if ck:
        checkpoint.load(ck[-1])  # the newest checkpoint always loads (raises if not)
    if case.target == "disk":
        return filled_as_documented(case, err, code, summary, ck)
    if case.sig != signal.SIGKILL:
        return stopped_as_documented(case, err, code, summary, ck, tmp)
    stuck = stuck_ranks(err)
    if 0 in stuck:
        return rank0_stuck_as_documented(case, trial, err, code, ck, stuck)
    if case.target in ("spare", "spare-joining"):
        return spare_killed_as_documented(case, trial, err, code, summary, ck, out)
    if case.target == "respawned":
        return replacement_killed_as_documented(case, err, code, summary, ck)
    if case.target in ("rank0-join", "rank0-respawn"):
        return join_failed_over_as_documented(case, trial, err, joiner, code, summary, ck)
    if case.target in ("rank0", "shard") and failover(case):
        return failed_over_as_documented(case, trial, err, code, summary, ck, out)
    if case.target == "rank0":
        if summary is not None and summary["global_step"] == case.steps:
            # Killed after it wrote the summary (its goodbyes sent, or being sent): nothing was
            # lost, and a worker that got its goodbye rightly ends without a word (measured: a
            # kill at 0.99 of the run's length). Hangs and leftovers were judged above.
            return []
        others = [r for r in range(1, NP)]
        said = [r for r in others if f"rank {r} lost the parameter server" in err or r in stuck]
        return [] if said == others else [f"only ranks {said} said they lost rank 0 (exit {code})"]
    if case.target == "shard":  # rank 0 ends the job naming the shard and the newest checkpoint
        if summary is not None and summary["global_step"] == case.steps:
            return []  # killed after the end of training: nothing was lost
        named = [ln for ln in err.splitlines() if "lost parameter-server shard 1/2 (rank 1:" in ln]
        if code != EXIT_PEER_LOST or len(named) != 1 or (ck and str(ck[-1]) not in named[0]):
            return [f"exit {code}; {len(named)} lines name shard 1 with the newest checkpoint"]
        return []
    if case.target == "joiner" and code == EXIT_PEER_LOST:
        # Killed between the job's making room and its next phase's heartbeats: every rank ends in
        # one line once join.FORM_LIMIT_S has passed, and the checkpoint saved then resumes the run.
        stuck = [ln for ln in err.splitlines() if "did not go on within" in ln]
        return [] if len(stuck) == NP and ck else [f"exit 5; {len(stuck)} of {NP} ranks said why"]
    if case.target == "supervisor":
        # hydra SIGKILLs every rank when one of its own children (a supervisor) dies by a signal.
        return [] if code != 0 and summary is None else [f"exit {code}; the job went on"]
    lost_lines = [ln for ln in err.splitlines() if f"worker rank {v} lost" in ln or f"lost worker rank {v}" in ln]
    if goes_on(case):
        problems = []
        if summary is None:
            return [f"no summary (exit {code})"]
        if summary["global_step"] != case.steps:
            problems.append(f"global step {summary['global_step']} of {case.steps}")
        lost = [w["rank"] for w in summary["lost_workers"]]
        if sorted(lost) == sorted({v, *stuck}):  # a worker stuck in MPI (stuck.py) ends, and is lost too
            if len(lost_lines) != 1:
                problems.append(f"{len(lost_lines)} lines name the lost rank")
        elif not (lost == [] and v in summary["worker_ranks"]):  # killed after it had reported: not lost
            problems.append(f"lost_workers {lost}, killed {v}")
        if not ck or checkpoint.load(ck[-1]).global_step != case.steps:
            problems.append("no final checkpoint at the budget")
        if case.mode == "sync" and summary["worker_param_digests"] != [summary["param_digest"]] * len(summary["worker_ranks"]):
            problems.append("replicas differ")
        respawned = [j for j in summary["joined_workers"] if j.get("respawned")]
        unreplaced = ("no worker was started in place", "the worker started in place of the lost one did not join")
        if "--respawn" in case.args and lost and not respawned and not any(line in out for line in unreplaced):
            problems.append("the lost worker was not replaced, and no line said why")
        spared = [j for j in summary["joined_workers"] if j.get("spare")]
        if case.spares and lost and not spared and not any(line in out for line in ("no worker was started in place",
                                                                                      "did not join")):
            problems.append("the lost worker's place did not go to the spare, and no line said why")
        # Not 0 when a worker was lost: a scheduler must see it. Killed after its report, nothing was
        # lost: rank 0's 0 (under hydra a killed worker's supervisor exits 0: supervise.killed_exit).
        want = ExitCode.WORKER_LOST if lost else 0
        if case.target == "joiner":  # not a rank of the job's mpirun: rank 0's own code
            want = ExitCode.WORKER_LOST if lost else 0
        # A survivor stuck in MPI ends with PEER_LOST (docs/lost-ranks.md), which hydra ORs into the job's code
        # (8 | 5 = 13: a sync survivor beside two CPU hogs, 2026-12-07); prterun gives rank 0's.
        if code != want and not (stuck and code == want | EXIT_PEER_LOST):
            problems.append(f"exit {code}")
        return problems
    # sync --on-lost-worker stop: the job ends naming the rank and the newest checkpoint; or it had finished already
    if summary is not None and summary["global_step"] == case.steps:
        return []
    if code != EXIT_PEER_LOST:
        return [f"exit {code}"]
    if len(lost_lines) != 1 or (ck and str(ck[-1]) not in lost_lines[0]):
        return [f"{len(lost_lines)} lines name rank {v} with the newest checkpoint"]
    return []


def replacement_killed_as_documented(case: Case, err: str, code: int, summary: dict | None, ck: list) -> list[str]:
    """respawn-mailbox: a worker killed, replaced, and its replacement killed (in the middle of a mailbox push,
    often): rank 0 drops it as any lost worker (--respawn 1 is spent: nobody replaces it), never applies a
    half-written push (a NaN would end the run as diverged), finishes the budget, and leaves no mailbox in
    /dev/shm."""
    if summary is None:
        return [f"no summary (exit {code})"]
    problems = []
    if summary["global_step"] != case.steps or "diverged" in err:
        diverged = ", diverged" if "diverged" in err else ""
        problems.append(f"global step {summary['global_step']} of {case.steps}{diverged}")
    if len(summary["lost_workers"]) not in (1, 2) or not summary["joined_workers"]:  # 1: killed after its report
        problems.append(f"lost {summary['lost_workers']}, joined {summary['joined_workers']}")
    if not ck or checkpoint.load(ck[-1]).global_step != case.steps:
        problems.append("no final checkpoint at the budget")
    # prterun takes a spawned process killed by a signal for its job's failure and exits 137, where a worker of its
    # own launch killed gives rank 0's WORKER_LOST (8); under hydra the killed replacement's supervisor exits 0: 8
    if code not in (ExitCode.WORKER_LOST, 128 + signal.SIGKILL):
        problems.append(f"exit {code}")
    left = [p for p in os.listdir("/dev/shm") if p.startswith(f"mpitrain-mail.{os.getuid()}.")]
    if left:
        problems.append(f"left in /dev/shm: {left}")
    return problems


def spare_killed_as_documented(case: Case, trial: Trial, err: str, code: int, summary: dict | None, ck: list,
                               out: str) -> list[str]:
    """--spares 1, the spare SIGKILLed (docs/elastic.md, Hot spares). While it waits: rank 0 drops it in one
    line and the job reaches its budget, nobody waiting in MPI_Finalize for it. While it takes a lost worker's
    place (spare-joining): as a joiner killed then, the job goes on without it (`did not join`) or, killed
    once the new world formed, loses it as any worker; killed inside the forming's collectives, every rank
    ends in one line FORM_LIMIT_S later (exit 5) with the checkpoint saved to make room. The job's exit code
    is rank 0's under either MPI (8 once a worker was lost, else 0): a killed spare's supervisor exits 0."""
    if "MPI_Finalize still waiting" in err:
        return ["a rank waited in MPI_Finalize for the dead spare"]
    if summary is None:
        stuck = [ln for ln in err.splitlines() if "did not go on within" in ln]
        ok = case.target == "spare-joining" and stuck and ck and code in STUCK_EXITS
        return [] if ok else [f"no summary (exit {code}); {len(stuck)} ranks said the world did not form"]
    problems = []
    if summary["global_step"] != case.steps:
        problems.append(f"global step {summary['global_step']} of {case.steps}")
    lost = [w["rank"] for w in summary["lost_workers"]]
    spared = [j for j in summary["joined_workers"] if j.get("spare")]
    if case.target == "spare" and (lost or spared or "is gone (its process has ended)" not in err):
        problems.append(f"lost {lost}, spares joined {len(spared)}; the spare's loss said: "
                        f"{'is gone' in err}")
    said = ("did not join", "died when the job had made room", "did not answer when the job had made room",
            "did not join as the world re-formed")
    if case.target == "spare-joining" and not spared and "is gone" not in err and not any(s in out for s in said):
        about = [ln for ln in out.splitlines() if "spare" in ln][-3:]  # rank 0's lines on it go to standard output
        problems.append(f"the spare neither joined nor was said to be gone (standard output: {about})")
    want = ExitCode.WORKER_LOST if lost else 0  # rank 0's, under either MPI (supervise.killed_exit)
    if code != want:
        problems.append(f"exit {code}")
    return problems


def _loads(path) -> bool:
    try:
        checkpoint.load(path)
        return True
    except Exception:  # noqa: BLE001 - any failure to load is the finding
        return False


def failed_over_as_documented(case: Case, trial: Trial, err: str, code: int, summary: dict | None,
                              ck: list, out: str = "") -> list[str]:
    """--on-lost-server continue: rank 1 takes over (a lost shard: the first worker serves it, rank 0
    stays), says so once, and the job reaches its budget with a final checkpoint there; sync loses no
    update, async at most two per worker (#49's goal). Killed after rank 0 wrote the summary, nothing
    was lost (as rank0's cases)."""
    if summary is None:
        return [f"no summary (exit {code})"]
    if not summary["failovers"]:
        return [] if summary["global_step"] == case.steps and "took over" not in err and "took it over" not in err else ["no failover recorded"]
    problems = []
    [fo] = summary["failovers"][:1]
    trial.lost_updates = fo["updates_lost_at_most"]
    trial.accuracy = summary["test_accuracy"]
    took = [ln for ln in err.splitlines() if "took over as rank 0" in ln or "took it over" in ln]
    successor, lost_shards = (0, [1]) if case.target == "shard" else (1, [0])
    if case.target == "rank0-respawn" and fo["successor"] == 2:  # the worker killed first was rank 1
        successor = 2
    if len(summary["failovers"]) != 1 or len(took) != 1 or (fo["successor"], fo["lost_shards"]) != (successor, lost_shards):
        problems.append(f"{len(summary['failovers'])} failovers, {len(took)} lines, successor {fo['successor']}, "
                        f"lost shards {fo['lost_shards']}")
    if summary["global_step"] != case.steps:
        problems.append(f"global step {summary['global_step']} of {case.steps}")
    if not ck or checkpoint.load(ck[-1]).global_step != case.steps:
        problems.append("no final checkpoint at the budget")
    unreadable = [c.name for c in ck[:-1] if not _loads(c)]  # rank 0 killed mid-write: its file is whole or absent
    if unreadable:
        problems.append(f"checkpoints that do not load: {unreadable}")
    limit = 0 if case.mode == "sync" or "shm" in case.args else 2 * (NP if case.target == "rank0-join" else NP - 1)
    if "--local-steps" in case.args:  # each push in flight carries H inner steps, each a global step
        limit *= int(case.args[case.args.index("--local-steps") + 1])
    if fo["updates_lost_at_most"] > limit:
        problems.append(f"{fo['updates_lost_at_most']} updates lost (more than {limit})")
    if case.mode == "sync" and summary["worker_param_digests"] != [summary["param_digest"]] * len(summary["worker_ranks"]):
        problems.append("replicas differ")
    if case.spares:  # the successor takes the spare over and lets it in at once, unless the budget was reached
        spared = [j for j in summary["joined_workers"] if j.get("spare") and j["global_step"] >= fo["global_step"]]
        if "took over the spares: 1 spare(s) waiting" not in out:
            problems.append("the successor did not take the spare over")
        elif not spared and not any(why in out for why in ("no worker was started in place", "did not join")):
            problems.append("the spare was not let in, and no line said why")
        elif spared and len(summary["worker_ranks"]) != NP - 1:
            problems.append(f"{len(summary['worker_ranks'])} workers at the end, not {NP - 1}")
    if code != ExitCode.WORKER_LOST | (RANK0_KILLED if trial.victim == 0 else 0):  # a shard server's: 0
        problems.append(f"exit {code}")
    return problems


def join_failed_over_as_documented(case: Case, trial: Trial, err: str, joiner: str, code: int, summary: dict | None,
                                   ck: list) -> list[str]:
    """Rank 0 killed while a worker joins (or, rank0-respawn, while a lost worker is replaced), with
    --on-lost-server continue. The job: a take-over as in failed_over_as_documented (the joiner, if it
    was in, among the workers; the successor may let it in later), or, killed once the new world was
    being formed with the joiner, every rank of it ending in one line when join.FORM_LIMIT_S has
    passed (exit 5; the checkpoint saved for the join resumes the run). The joiner: in the job to its
    end, or ended on its own with one mpitrain line."""
    problems = []
    if summary is not None:
        problems += failed_over_as_documented(case, trial, err, code, summary, ck)
    elif any("did not go on within" in ln for ln in err.splitlines()):  # every rank left in the forming world
        said = sum("did not go on within" in ln for ln in err.splitlines())
        if code not in STUCK_EXITS or not ck or said < NP - 2:  # (rank0-respawn: one worker fewer)
            problems.append(f"exit {code} after the forming world timed out ({said} of {NP - 1} ranks said so; "
                            f"checkpoint: {bool(ck)})")
    else:
        problems.append(f"no summary and no forming time-out (exit {code})")
    joined = summary is not None and any(j.get("rank") is not None for j in summary.get("joined_workers", []))
    said = [ln for ln in joiner.splitlines() if ln.startswith("mpitrain: ") and ("error" in ln or "could not" in ln
                                                                               or "did not" in ln or "lost" in ln)]
    if case.target == "rank0-join" and trial.joiner_code != 0 and not joined and not said:
        problems.append(f"the joiner ended with exit {trial.joiner_code} and no line saying why")
    return problems


def stuck_ranks(err: str) -> list[int]:
    """The ranks that said their MPI no longer returns (stuck.py), each in its one line."""
    return sorted(int(ln.split()[2].rstrip(":")) for ln in err.splitlines()
                  if ln.startswith("mpitrain: rank ") and STUCK_LINE in ln)


def rank0_stuck_as_documented(case: Case, trial: Trial, err: str, code: int, ck: list, stuck: list[int]) -> list[str]:
    """The victim died half-way through handing rank 0 a message, and MPICH's progress on rank 0
    then never returns (stuck.py): rank 0 says so in one line, naming the checkpoint it saved with
    one server; every other rank says it lost rank 0 (or is stuck too); the job ends with
    PEER_LOST (the killed worker's supervisor exits 0: supervise.killed_exit) and the newest checkpoint resumes it."""
    problems = []
    line = [ln for ln in err.splitlines() if ln.startswith(f"mpitrain: rank 0: {STUCK_LINE}")]
    if len(line) != 1:
        problems.append(f"{len(line)} stuck lines from rank 0")
    elif "--num-ps" not in case.args and ck and f"to {ck[-1]};" not in line[0]:
        problems.append("rank 0 did not name the checkpoint it saved")
    left = [r for r in range(1, NP) if r != trial.victim]
    quiet = [r for r in left if f"rank {r} lost the parameter server" not in err and r not in stuck]
    if quiet:
        problems.append(f"ranks {quiet} did not say they lost rank 0")
    if code not in STUCK_EXITS:
        problems.append(f"exit {code}")
    return problems


def filled_as_documented(case: Case, err: str, code: int, summary: dict | None, ck: list) -> list[str]:
    """The disk filled up: training finished anyway, one line said so, the newest good checkpoint
    stayed, and the exit code says whether the final checkpoint is missing (6) or not (0)."""
    if summary is None or summary["global_step"] != case.steps:
        return [f"training did not finish (exit {code})"]
    failed = [ln for ln in err.splitlines() if "not written" in ln]
    final_saved = bool(ck) and checkpoint.load(ck[-1]).global_step == case.steps
    problems = [] if code == (0 if final_saved else 6) else [f"exit {code} (final checkpoint saved: {final_saved})"]
    if len(failed) > 1 or (not final_saved and not failed):
        problems.append(f"{len(failed)} lines say a write failed")
    if any(p.name.endswith(".tmp") for p in (ck[-1].parent.iterdir() if ck else [])):
        problems.append("a temporary file was left")
    return problems


def stopped_as_documented(case: Case, err: str, code: int, summary: dict | None, ck: list, tmp: Path) -> list[str]:
    """A stop signal: the summary says where it stopped, the final checkpoint is that step, the
    exit code is 128 + the signal, and the same command resumes from it (or the run had finished)."""
    # Open MPI's mpirun turns its SIGTERM or SIGINT into a SIGTERM of each rank and exits 1 (Impl.stop_exit),
    # even when the signal came after training ended
    by_prterun = case.target == "launcher" and IMPL.stop_exit is not None
    if summary is not None and summary["global_step"] == case.steps and summary["stopped"] is None:
        return [] if code in (0, IMPL.stop_exit if by_prterun else 0) else [f"finished, exit {code}"]
    if summary is None or summary["stopped"] is None:
        if by_prterun and code == IMPL.stop_exit:
            # prterun SIGKILLs the ranks 2 s after its SIGTERM: a stop that needs longer ends as a
            # kill at that moment does (docs/openmpi.md); the newest checkpoint loaded above
            return []
        return [f"no summary of the stop (exit {code})"]
    step = summary["stopped"]["global_step"]
    sig = signal.SIGTERM if by_prterun else case.sig
    problems = [] if code == (IMPL.stop_exit if by_prterun else 128 + case.sig) else [f"exit {code}"]
    if summary["stopped"]["signal"] != signal.Signals(sig).name:
        problems.append(f"stopped by {summary['stopped']['signal']}")
    if not ck or checkpoint.load(ck[-1]).global_step != step:
        problems.append(f"no final checkpoint at step {step}")
    resumed = subprocess.run([*command(Case(case.name, case.args, case.target, step + 20), str(tmp))],
                             capture_output=True, text=True, env=env(), cwd=tmp, timeout=120)
    after = json.loads((tmp / "summary.json").read_text()) if resumed.returncode == 0 else {}
    if after.get("global_step") != step + 20 or not str(after.get("resumed_from", "")).endswith(f"{step:09d}.npz"):
        problems.append(f"the resume did not continue from step {step} (exit {resumed.returncode})")
    if "Traceback" in resumed.stderr:
        problems.append("a traceback in the resumed run")
    return problems


