"""validate(): the checks on a TrainConfig that need no file system or MPI (worldcheck.py has those that
need the world size), each a UsageError of one line naming the problem and the fix."""

from __future__ import annotations

from mpitrain.core.config import (DATASET_PREFIXES, DATASETS, DEFAULT_DC_LAMBDA, DEFAULT_STALENESS_TOLERANCE, DEVICES,
                                  LOST_SERVER_CHOICES, LR_SCALINGS, MODES, NPZ_PREFIX, OUTER_OPTIMIZERS, PS_DEVICES,
                                  TFDS_PREFIX, WAITS, TrainConfig, UsageError, can_take_joiners, codec_names,
                                  model_names, optimizer_names)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of: {', '.join(allowed)}")


def _not_with(what: str, *pairs: tuple[object, str]) -> None:
    """One line for the first flag given (a pair's first item) that `what` does not work with yet."""
    for given, flag in pairs:
        if given:
            raise UsageError(f"{what} does not go with {flag} yet; drop one of the two")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise UsageError naming the problem and the fix; return cfg unchanged when it is fine.

    Only checks that need no file system or MPI live here, so every rank reaches the same verdict.
    """
    _choice("mode", cfg.mode, MODES)
    _choice("on_lost_server", cfg.on_lost_server, LOST_SERVER_CHOICES)
    if cfg.join and not cfg.checkpoint_dir:
        raise UsageError("--join finds the running job through its folder: give the job's --checkpoint-dir too")
    for flag, what in (("respawn", "the most lost workers to replace, e.g. 3"), ("spares", "how many ranks wait, e.g. 1")):
        if getattr(cfg, flag) < 0:
            raise UsageError(f"--{flag} must be zero (none) or {what} (got {getattr(cfg, flag)})")
    if cfg.respawn and not isinstance(cfg.model, str):
        raise UsageError("respawn starts a worker as `python -m mpitrain` with the job's flags, which cannot carry a "
                         "Python model object; use a built-in --model, or respawn=0")
    for flag in ("respawn", "spares"):  # both let a worker in in place of a lost one (join.py)
        if getattr(cfg, flag) and not can_take_joiners(cfg):
            raise UsageError(f"--{flag} lets a worker in through the job's folder and heartbeats: give "
                             "--checkpoint-dir DIR and a --worker-timeout above 0 too")
        if getattr(cfg, flag) and cfg.on_lost_worker == "stop":
            raise UsageError(f"--{flag} replaces a lost worker, but --on-lost-worker stop ends the job when one is "
                             "lost; drop one of the two")
    if isinstance(cfg.model, str):  # else a Model object of the user's (the API checked its members)
        _choice("model", cfg.model, model_names())
    _choice("optimizer", cfg.optimizer, optimizer_names())
    prefix = next((p for p in DATASET_PREFIXES if cfg.dataset.startswith(p)), None)
    if prefix is None and cfg.dataset.endswith(".npz"):
        raise UsageError(f"--dataset {cfg.dataset}: a file of your own arrays is named with npz:, as in "
                         f"--dataset {NPZ_PREFIX}{cfg.dataset}")
    if prefix is None:
        _choice("dataset", cfg.dataset, DATASETS + tuple(p + arg for p, (arg, _, _) in DATASET_PREFIXES.items()))
    elif cfg.dataset == prefix:
        _, what, example = DATASET_PREFIXES[prefix]
        raise UsageError(f"--dataset {prefix} needs {what} after the colon, e.g. --dataset {example}")
    if (cfg.train_split, cfg.test_split) != ("train", "test") and prefix != TFDS_PREFIX:
        raise UsageError("--train-split/--test-split name tensorflow-datasets splits: use them with --dataset tfds:NAME")
    _choice("device", cfg.device, DEVICES)
    _choice("compress", cfg.compress, codec_names())
    _gathered_exchange(cfg)
    _choice("ps_device", cfg.ps_device, PS_DEVICES)
    if cfg.ps_device == "gpu" and cfg.mode != "async":
        raise UsageError("--ps-device gpu applies to --mode async (in sync mode the workers apply the updates "
                         "on their own devices); drop it")
    _choice("wait", cfg.wait, WAITS)
    if cfg.outer_optimizer is not None:
        _choice("outer_optimizer", cfg.outer_optimizer, OUTER_OPTIMIZERS)
    if cfg.lr_scaling is not None:
        _choice("lr_scaling", cfg.lr_scaling, LR_SCALINGS)
        if cfg.lr_scaling == "linear" and cfg.mode != "sync":
            raise UsageError("--lr-scaling linear applies to --mode sync (an async update is one worker's gradient); "
                             "drop it, or use --mode sync")
    if not 0 <= cfg.warmup_epochs < float("inf"):
        raise UsageError(f"--warmup-epochs must be zero or more (got {cfg.warmup_epochs}); e.g. --warmup-epochs 1")
    if not (cfg.worker_timeout >= 0 and cfg.worker_timeout < float("inf")):
        raise UsageError(f"--worker-timeout must be zero (never) or a positive number of seconds "
                         f"(got {cfg.worker_timeout}); e.g. --worker-timeout 30")
    if cfg.num_ps < 1:
        raise UsageError(f"--num-ps must be at least 1 (got {cfg.num_ps}); e.g. --num-ps 2 (ranks 0 and 1 serve)")
    if cfg.batch_size <= 0:
        raise UsageError(f"--batch-size must be a positive integer (got {cfg.batch_size}); e.g. --batch-size 100")
    if cfg.lr is not None and not cfg.lr > 0:
        raise UsageError(f"--lr must be positive (got {cfg.lr}); e.g. --lr 0.1, or leave it out for "
                         f"{cfg.optimizer}'s default")
    if not 0 < cfg.lr_decay <= 1:
        raise UsageError(f"--lr-decay must be in (0, 1] (got {cfg.lr_decay}); 1 turns decay off")
    if not 0 <= cfg.momentum < 1:
        raise UsageError(f"--momentum must be in [0, 1) (got {cfg.momentum}); e.g. --momentum 0.9")
    if cfg.ema_decay is not None and not 0 < cfg.ema_decay < 1:
        raise UsageError(f"--ema-decay must be in (0, 1) (got {cfg.ema_decay}); the seeds used 0.99")
    if not (cfg.divergence_factor == 0 or 1 < cfg.divergence_factor < float("inf")):
        raise UsageError(f"--divergence-factor must be above 1, or 0 to turn the check off "
                         f"(got {cfg.divergence_factor}); e.g. --divergence-factor 100")
    if cfg.l2 < 0:
        raise UsageError(f"--l2 must be zero or positive (got {cfg.l2}); e.g. --l2 1e-4")
    if cfg.epochs is not None and cfg.epochs <= 0:
        raise UsageError(f"--epochs must be a positive integer (got {cfg.epochs}); e.g. --epochs 10")
    if cfg.steps is not None and cfg.steps <= 0:
        raise UsageError(f"--steps must be a positive integer (got {cfg.steps}); e.g. --steps 500")
    if cfg.seed < 0:  # NumPy's generators take no negative seed (a traceback on rank 0, the others waiting)
        raise UsageError(f"--seed must be zero or more (got {cfg.seed}); e.g. --seed 1")
    if cfg.model == "mlp" and (not cfg.hidden or any(h <= 0 for h in cfg.hidden)):
        raise UsageError(f"--hidden needs positive layer widths (got {cfg.hidden}); e.g. --hidden 100 or --hidden 256,128")
    if cfg.synthetic_samples < 2:
        raise UsageError(f"--synthetic-samples must be at least 2 (got {cfg.synthetic_samples})")
    if cfg.synthetic_features <= 0:
        raise UsageError(f"--synthetic-features must be positive (got {cfg.synthetic_features})")
    if cfg.quorum is not None:
        if cfg.mode != "sync":
            raise UsageError("--quorum applies to --mode sync; async never waits for a slow worker "
                             "(bound its staleness with --max-staleness)")
        if cfg.quorum < 1:
            raise UsageError(f"--quorum must be at least 1 (got {cfg.quorum}); e.g. --quorum 2")
    if cfg.max_staleness is not None:
        if cfg.mode != "async":
            raise UsageError("--max-staleness applies to --mode async; in sync mode every gradient is fresh")
        if cfg.max_staleness < 0:
            raise UsageError(f"--max-staleness must be zero or more (got {cfg.max_staleness})")
    if cfg.staleness_lr and cfg.mode != "async":
        raise UsageError("--staleness-lr applies to --mode async (sync gradients are never stale)")
    if cfg.staleness_lr is not None and not 0 <= cfg.staleness_lr < float("inf"):
        raise UsageError(f"--staleness-lr takes a K of zero (off) or more (got {cfg.staleness_lr}); "
                         f"e.g. --staleness-lr {DEFAULT_STALENESS_TOLERANCE:g}")
    if cfg.local_steps < 1:
        raise UsageError(f"--local-steps must be at least 1 (got {cfg.local_steps}); e.g. --local-steps 16")
    if cfg.local_steps > 1 and cfg.mode == "async":
        _not_with("--local-steps in async mode", (cfg.delay_compensation is not None, "--delay-compensation"))
    if cfg.local_steps == 1 and any(x is not None for x in (cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum)):
        raise UsageError("--outer-optimizer, --outer-lr and --outer-momentum apply with --local-steps H above 1; "
                         "e.g. --local-steps 16 --outer-optimizer sgd")
    if cfg.outer_lr is not None and not 0 < cfg.outer_lr < float("inf"):
        raise UsageError(f"--outer-lr must be positive (got {cfg.outer_lr})")
    if cfg.outer_optimizer == "delayed-nesterov" and cfg.mode != "async":
        raise UsageError("--outer-optimizer delayed-nesterov is async's (pushes one by one); sync's outer step "
                         "averages every worker: use nesterov")
    if cfg.outer_overlap is not None:
        _outer_overlap(cfg)
    if cfg.fragments != 1:
        _fragments(cfg)
    if cfg.outer_momentum is not None and not 0 <= cfg.outer_momentum < 1:
        raise UsageError(f"--outer-momentum must be in [0, 1) (got {cfg.outer_momentum})")
    if cfg.ps_transport == "shm":  # as far as it goes so far (docs/modes.md, "One host")
        _not_with("--ps-transport shm", (cfg.mode != "async", "--mode sync (its Allreduce has no server)"),
                  (cfg.overlap, "--overlap"), (cfg.ps_device == "gpu", "--ps-device gpu"))
    if cfg.on_lost_server == "continue":
        if cfg.worker_timeout <= 0:
            raise UsageError("--on-lost-server continue needs heartbeats to tell a lost rank 0: give a "
                             "--worker-timeout above 0 (e.g. 3)")
    if cfg.delay_compensation is not None:
        if cfg.mode != "async":
            raise UsageError("--delay-compensation applies to --mode async (sync gradients are never stale)")
        if not 0 <= cfg.delay_compensation < float("inf"):
            raise UsageError(f"--delay-compensation takes a lambda of zero or more (got {cfg.delay_compensation}); "
                             f"e.g. --delay-compensation {DEFAULT_DC_LAMBDA:g}")
    if not (cfg.straggler_report == 0 or 1 < cfg.straggler_report < float("inf")):
        raise UsageError(f"--straggler-report must be above 1, or 0 to name no slow worker "
                         f"(got {cfg.straggler_report}); e.g. --straggler-report 1.5")
    if not 0 <= cfg.stall_warning < float("inf"):
        raise UsageError(f"--stall-warning must be zero (never) or a positive number of seconds "
                         f"(got {cfg.stall_warning}); e.g. --stall-warning 60")
    if cfg.timeline_steps <= 0:
        raise UsageError(f"--timeline-steps must be a positive number of steps (got {cfg.timeline_steps}); "
                         f"e.g. --timeline-steps 100")
    for flag, n in (("log-every", cfg.log_every), ("eval-every", cfg.eval_every),
                    ("checkpoint-every-steps", cfg.checkpoint_every_steps)):
        if n is not None and n <= 0:
            raise UsageError(f"--{flag} must be a positive number of global steps (got {n})")
    if cfg.eval_at_end and cfg.eval_every is None:
        raise UsageError("--eval-at-end evaluates what --eval-every copies: give --eval-every N too")
    if cfg.checkpoint_every_secs <= 0:
        raise UsageError(f"--checkpoint-every-secs must be positive (got {cfg.checkpoint_every_secs}); e.g. 60")
    if cfg.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be at least 1 (got {cfg.keep_checkpoints})")
    if cfg.cuda_aware and cfg.device == "cpu":
        raise UsageError("--cuda-aware hands GPU buffers to MPI and needs --device gpu (or auto), not cpu")
    if cfg.cuda_aware and cfg.compress != "none" and cfg.mode == "sync":
        raise UsageError(f"--compress {cfg.compress} in sync mode sums on the host and cannot use --cuda-aware; "
                         "drop one of the two")
    if cfg.data_dir is not None and (cfg.dataset in ("digits", "synthetic") or prefix == NPZ_PREFIX):
        raise UsageError(f"--data-dir is only read for mnist/fashion_mnist and tfds:NAME, not {cfg.dataset}; "
                         f"drop it or pick --dataset mnist")
    return cfg


def _gathered_exchange(cfg: TrainConfig) -> None:
    """--compress int8 / int4 and --sparsify (core/compress.py): sync's gathered parts, async's and --quorum's
    pushes (with --num-ps K, each server's slice), and with --compress-replies async's replies and sync's sums."""
    from mpitrain.core.compress import QUANTIZERS

    if cfg.sparsify is not None:
        if not 0 < cfg.sparsify <= 100:
            raise UsageError(f"--sparsify takes the percent of entries each exchange sends, above 0 and at most "
                             f"100 (got {cfg.sparsify:g}); e.g. --sparsify 2")
        if cfg.compress not in ("none", *QUANTIZERS):
            raise UsageError(f"--sparsify sends float32 or quantised values, not {cfg.compress}: use it with "
                             f"--compress none, {' or '.join(QUANTIZERS)}")
    if cfg.compress not in QUANTIZERS and cfg.sparsify is None:
        if cfg.compress_replies:
            raise UsageError("--compress-replies sends rank 0's replies in the pushes' scheme: give one, e.g. "
                             "--compress int8 --compress-replies")
        return
    what = f"--compress {cfg.compress}" if cfg.compress in QUANTIZERS else "--sparsify"
    if cfg.compress_replies and cfg.quorum is not None:
        raise UsageError(f"--compress-replies does not go with --quorum: its {what} pushes go to the coordinator, "
                         f"which sends each step's average in float32; drop --compress-replies")
    if cfg.compress_replies and cfg.ps_transport == "shm":
        raise UsageError("--compress-replies does not go with --ps-transport shm yet (a worker on the store's "
                         "host reads the parameters there); drop one of the two")


def _outer_overlap(cfg: TrainConfig) -> None:
    """--outer-overlap T: sync's, with --local-steps H, and T inner steps of the next H."""
    if cfg.mode != "sync":
        raise UsageError("--outer-overlap is sync's: in async, --overlap computes a worker's next H steps while its "
                         "outer gradient travels; e.g. --local-steps 16 --overlap")
    if cfg.quorum is not None:
        raise UsageError("--outer-overlap applies to --mode sync without --quorum (a quorum's round is its own); "
                         "e.g. --mode sync --local-steps 16 --outer-overlap 8")
    if cfg.local_steps == 1:
        raise UsageError("--outer-overlap applies with --local-steps H above 1 (an outer step to overlap); "
                         "e.g. --local-steps 16 --outer-overlap 8")
    if not 0 <= cfg.outer_overlap < cfg.local_steps:
        raise UsageError(f"--outer-overlap takes 0 to H - 1 inner steps of --local-steps H (got {cfg.outer_overlap} "
                         f"with --local-steps {cfg.local_steps}); e.g. --local-steps 16 --outer-overlap 8")


def _fragments(cfg: TrainConfig) -> None:
    """--fragments F: sync's, with --local-steps H that F divides (with --outer-overlap T: T below H/F)."""
    eg = "e.g. --mode sync --local-steps 16 --fragments 4"
    if cfg.mode != "sync" or cfg.quorum is not None or cfg.local_steps == 1:
        raise UsageError(f"--fragments applies to --mode sync with --local-steps H above 1, without --quorum; {eg}")
    if cfg.fragments < 1 or cfg.local_steps % cfg.fragments:
        raise UsageError(f"--fragments F must divide --local-steps H (got F {cfg.fragments}, H {cfg.local_steps}), "
                         f"so that each fragment's outer step comes every H steps; {eg}")
    span = cfg.local_steps // cfg.fragments
    if cfg.outer_overlap is not None and cfg.outer_overlap >= span:
        raise UsageError(f"--outer-overlap T with --fragments F lands each fragment before the next one is sent: T "
                         f"takes 0 to H/F - 1 (got T {cfg.outer_overlap}, H/F {span}); e.g. --local-steps 16 "
                         f"--fragments 4 --outer-overlap 2")
