"""Command lines of train.py, evaluate.py and generate.py (exit statuses and one-line errors: xlm_pkm/errors.py)."""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import sys
from pathlib import Path

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.config import add_plugins_option, import_plugins
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.errors import EXIT_INTERRUPTED, EXIT_STOPPED, USER_ERRORS, ConfigError, UserError, fail
from xlm_pkm.inference.generation import generate
from xlm_pkm.inference.sampling import Sampling
from xlm_pkm.launch.config_keys import describe_keys
from xlm_pkm.launch.resume import resume_command, stop_status
from xlm_pkm.launch.run_config import launch_config
from xlm_pkm.runtime.distributed import (
    CollectiveError,
    describe_failure,
    init_distributed,
    is_collective_failure,
    read_env,
    shutdown,
)
from xlm_pkm.runtime.hardware import is_out_of_memory
from xlm_pkm.runtime.precision import check_precision, resolve_device
from xlm_pkm.train.build import resolved_config
from xlm_pkm.train.evaluation import evaluate_checkpoint
from xlm_pkm.train.memory_estimate import estimate
from xlm_pkm.train.trainer import Trainer
from xlm_pkm.utils.atomic import OutputError, check_writable, holds_json_with, refuse_foreign_file, write_text
from xlm_pkm.utils.path_component import check_path_length
from xlm_pkm.utils.program import program_name
from xlm_pkm.utils.stop_signals import STOP_SIGNALS, StoppedBySignal, ignore_stop_signals, restore_defaults


def _interrupted(trainer: Trainer | None) -> UserError:
    if trainer is None:
        return UserError("interrupted (Ctrl-C) before training started")
    if trainer.saved_step == trainer.step:
        return UserError(f"interrupted (Ctrl-C) at step {trainer.step}, after its checkpoint was written whole: "
                         f"{trainer.ckpt_path}")
    return UserError(f"interrupted (Ctrl-C) at step {trainer.step}, not saved. {trainer.checkpoints.last_good()}")


def _stopped_outside_training(trainer: Trainer | None, signal_name: str, testing: bool) -> UserError:
    if trainer is None:
        return UserError(f"stopped by {signal_name} during start-up, before any step: nothing trained; run the "
                         f"same command again")
    if testing:
        return UserError(f"stopped by {signal_name} after training, during the test evaluation: the run is saved "
                         f"(step {trainer.saved_step}); run the same command again for its test figures")
    return UserError(f"stopped by {signal_name} after training, as the run closed: the run is saved (step "
                     f"{trainer.saved_step})")


def _ignore_stop_signals_until_exit() -> None:
    """The stop signals ignored from now until the process exits (their defaults would end it with 143, 129...),
    set with them blocked: not one lands between restore_defaults and ignore_stop_signals."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        restore_defaults()  # its unraisable hook and held signal cleared
        ignore_stop_signals()  # one pending is discarded
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _failed_collective(error: BaseException) -> BaseException | None:
    """The failed collective that `error` is, or that was being handled when it was raised (torchrun's SIGTERM to
    the ranks that survive a dead one lands while they close the run)."""
    while error is not None and not is_collective_failure(error):
        error = error.__context__
    return error


def _peer_failure(trainer: Trainer | None, argv: list[str], error: BaseException) -> UserError:
    """The one line of a failed collective (a rank died or froze: describe_failure), with, for a run, the step
    and the checkpoint it resumes from. Stop signals are ignored from here on: the launcher's SIGTERM, sent
    when it sees a rank gone, would replace the line."""
    ignore_stop_signals()
    failure = describe_failure(read_env(), error)
    if trainer is None:
        return failure
    if trainer.saved_step is None:
        return CollectiveError(f"{failure}; this run stopped after step {trainer.step}, before writing a checkpoint")
    return CollectiveError(f"{failure}; this run stopped after step {trainer.step}: its last checkpoint, "
                           f"{trainer.ckpt_path} (step {trainer.saved_step}), is intact; to resume: "
                           f"{resume_command(argv, trainer.cfg.train.exp_id)}")


def _out_of_memory(trainer: Trainer | None, error: Exception) -> UserError:
    where = "while building the run" if trainer is None else f"at step {trainer.step + 1}"
    saved = "" if trainer is None else f" {trainer.checkpoints.last_good()}"
    size = re.search(r"[Tt]ried to allocate (\d+ bytes|[\d.]+ [KMGT]iB)", str(error))
    what = f"an allocation of {size.group(1)} failed" if size else type(error).__name__
    return UserError(f"out of memory {where} ({what}): lower data.batch_size (optim.accumulate keeps the tokens "
                     f"per step) or the model's size, or raise the process's memory limit.{saved}")


def format_result(result: dict) -> str:
    measure = f"bpc {result['bpc']:.4f}" if "bpc" in result else f"ppl {result['ppl']:.2f}"
    lines = [f"{result['split']} {measure} over {result['tokens']:,} tokens "
             f"({result['tokens_per_sec']:,.0f} tokens/s, {result['words_per_sec']:,.0f} words/s)"]
    for m in result["memories"]:
        lines.append(f"  memory at layer {m['layer']}: usage {m['usage']:.1f}% (by count {m['usage_count']:.1f}%), "
                     f"KL {m['kl']:.3f} (by count {m['kl_count']:.3f})")
    for e in result.get("engrams", []):  # absent from results of earlier versions
        lines.append(f"  Engram at layer {e['layer']}: {e['usage']:.1f}% of its {e['rows']:,} rows read, "
                     f"KL {e['kl']:.3f}")
    return "\n".join(lines)


def is_result_file(path: Path) -> bool:
    """Whether `path` holds a result that evaluate.py wrote (--json)."""
    return holds_json_with(path, {"split", "tokens", "memories"})


def _dry_run(args) -> None:
    """train.py --dry-run: the run's config resolved as training would (its vocabulary size from the data's
    vocab file unless model.vocab_size sets it, model.memory.shard_values=auto for its world size), its memory
    estimate per rank printed on rank 0."""
    cfg = launch_config(args.config, args.overrides)
    if cfg.model.base.path:
        raise ConfigError("--dry-run counts the parts of xlm_pkm's own transformer: a retrofit (model.base.path) is "
                          "not estimated")
    env = read_env()
    world_size = args.world_size or env.world_size
    vocab_size = cfg.model.vocab_size or len(Dictionary.load(Path(cfg.data.path) / "vocab"))
    cfg = resolved_config(cfg, vocab_size, cfg.train.exp_id, world_size)
    if env.is_main:
        print(estimate(cfg, world_size, cfg.train.parallel))


def train_main(argv: list[str] | None = None, exits: bool = False) -> int:
    """train.py's command line; returns its exit status. `exits`: the process ends once this returns (train.py,
    xlm-pkm-train: launch/commands.py); a run stopped to be resumed (exit 75) then leaves the stop signals ignored,
    so that one more landing while the process ends (a second scancel, kill, Ctrl-C) does not end it with 143
    in place of 75. Within another program (the reproduction harness, tests) they get their defaults back."""
    prog = program_name("train.py")
    parser = argparse.ArgumentParser(
        prog=prog, description="Train a transformer LM with product key memories.",
        epilog="Config keys, their defaults and what they do: --keys (every section) or --keys SECTION "
               "(e.g. --keys train). Ctrl-C stops like SIGTERM: a checkpoint, the resume command, exit 75; "
               "a second Ctrl-C stops at once. train.exp_id=ID (or last: the latest unfinished run of "
               "train.exp_name) resumes that run from its own config.yaml, the overrides on top.")
    parser.add_argument("--config", help="YAML config (default: configs/default.yaml; a resumed run starts from its "
                                         "own config.yaml, this file's keys and the overrides on top)")
    parser.add_argument("--no-test", action="store_true",
                        help="skip the test-set evaluation of best.pt at the end (a run started with it keeps it when "
                             "resumed)")
    parser.add_argument("--keys", nargs="?", const="", metavar="SECTION",
                        help="list the config keys (of SECTION: model, data, optim, train...) with the values this "
                             "command would train with (--config, default configs/default.yaml, and the overrides; "
                             "the built-in default beside where it differs) and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the memory each rank needs (parameters, gradients, optimizer state, "
                             "activations) and exit, without training or reading data beyond the vocabulary")
    parser.add_argument("--world-size", type=int, default=0, metavar="W",
                        help="with --dry-run: the number of processes (default: torchrun's or SLURM's, else 1)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_intermixed_args(argv)  # options and overrides in any order
    if args.world_size < 0 or args.world_size and not args.dry_run:
        parser.error("--world-size takes W >= 1, with --dry-run (a training run's processes are its launcher's)")
    if args.keys is not None or args.dry_run:
        try:
            if args.dry_run:
                _dry_run(args)
            else:
                print(describe_keys(args.keys, launch_config(args.config, args.overrides)))
        except USER_ERRORS as e:
            return fail(prog, e)
        return 0
    failed, trainer, testing = False, None, False
    try:
        trainer = Trainer(launch_config(args.config, args.overrides), test=not args.no_test)
        try:
            trainer.train(keep_stopping=True)  # stopping: a second stop signal (not Ctrl-C) is ignored while it closes
            if trainer.test and trainer.best_path.exists() and trainer.step >= trainer.cfg.train.max_steps:
                testing = True
                result = evaluate_checkpoint(trainer.best_path, "test", device=trainer.device,
                                             precision=trainer.cfg.train.precision, env=trainer.env)
                trainer.log.event("test", trainer.step, **{k: v for k, v in result.items() if k != "step"})
                trainer.log.info(format_result(result))
                testing = False
        finally:  # stopped, failed or interrupted with a checkpoint to go on from: how to resume (unless it is gone)
            if (trainer.saved_step is not None and trainer.saved_step < trainer.cfg.train.max_steps
                    and not trainer.run_dir_removed):
                trainer.log.info(f"to resume (with the same launcher and number of processes): "
                                 f"{resume_command(argv, trainer.cfg.train.exp_id)}")
            trainer.close()
    except USER_ERRORS as e:
        return fail(prog, e)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop, or a second one inside it
        return fail(prog, _interrupted(trainer), EXIT_INTERRUPTED)
    except StoppedBySignal as e:  # outside the training loop: start-up, a checkpoint load, the test evaluation
        if _failed_collective(e) is not None:  # or the launcher ending this rank, while it closes after a failure
            failed = True
            return fail(prog, _peer_failure(trainer, argv, _failed_collective(e)))
        error = _stopped_outside_training(trainer, e.name, testing)
        fail(prog, error, EXIT_STOPPED)
        return stop_status(f"{prog}: {error}", read_env().is_main)
    except Exception as e:
        if is_out_of_memory(e):
            return fail(prog, _out_of_memory(trainer, e))
        if not is_collective_failure(e):
            raise
        failed = True
        return fail(prog, _peer_failure(trainer, argv, e))
    finally:
        if exits and trainer is not None and trainer.stopped and trainer.step < trainer.cfg.train.max_steps:
            _ignore_stop_signals_until_exit()
        else:
            restore_defaults()
        shutdown(failed)
    if trainer.stopped and trainer.step < trainer.cfg.train.max_steps:
        return stop_status(f"{prog}: stopped at step {trainer.step}, checkpoint saved; to resume (with the same "
                           f"launcher and number of processes): {resume_command(argv, trainer.cfg.train.exp_id)}",
                           trainer.env.is_main)
    return 0  # finished


def evaluate_main(argv: list[str] | None = None) -> int:
    prog = program_name("evaluate.py")
    parser = argparse.ArgumentParser(prog=prog, description="Perplexity, memory usage and KL, speed.")
    parser.add_argument("--checkpoint", required=True, help="checkpoint.pt or best.pt of a run, or an exported folder")
    parser.add_argument("--split", default="test", choices=["valid", "test"])
    parser.add_argument("--data", help="processed data directory (default: the one the model was trained on, "
                                       "data.path of its config)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--batch-size", type=int, default=0, help="default: the run's eval batch size")
    parser.add_argument("--bptt", type=int, default=0, help="default: the run's bptt")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--max-batches", type=int, default=0,
                        help="the tokens of one process's first N batches, split across the ranks (the same on any "
                             "number of processes); 0: the whole split")
    add_plugins_option(parser)
    args = parser.parse_args(argv)
    try:
        import_plugins(args.plugins)
        if args.batch_size < 0 or args.bptt < 0 or args.max_batches < 0:
            raise ValueError("--batch-size, --bptt and --max-batches must be >= 0 (0: the run's own)")
        if args.json:  # before evaluating, not after
            if problem := check_path_length(args.json, "--json"):
                raise OutputError(problem)
            refuse_foreign_file(Path(args.json), is_result_file, "--json", "a result written by evaluate.py")
            check_writable(Path(args.json))
        device = resolve_device(args.device, "--device")
        check_precision(args.precision, device, "--precision")
        env = init_distributed(device)
        result = evaluate_checkpoint(args.checkpoint, args.split, args.data, args.batch_size, args.bptt,
                                     device, args.precision, args.max_batches, env)
        if env.is_main:
            print(format_result(result))
        if not math.isfinite(result["ppl"]):  # every rank: the same status
            raise UserError(f"{args.checkpoint}: {args.split} perplexity is {result['ppl']}: its weights give no "
                            f"finite prediction (a diverged run's checkpoint); evaluate an earlier one (the run's "
                            f"best.pt){f', {args.json} not written' if args.json else ''}")
        if env.is_main and args.json:
            write_text(Path(args.json), json.dumps(result, indent=2) + "\n")
    except USER_ERRORS as e:
        return fail(prog, e)
    finally:
        shutdown()
    return 0


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_file:
        raise ValueError("give the prompt as an argument or with --prompt-file, not both")
    if not args.prompt_file:
        return args.prompt or ""
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise FileNotFoundError(f"cannot read prompt file {args.prompt_file}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {args.prompt_file} is not UTF-8 ({e.reason})") from None


def generate_main(argv: list[str] | None = None) -> int:
    prog = program_name("generate.py")
    parser = argparse.ArgumentParser(prog=prog, description="Sample text from a trained model.")
    parser.add_argument("prompt", nargs="?", help="text to continue (default: start a new document)")
    parser.add_argument("--checkpoint", required=True, help="best.pt or checkpoint.pt of a run, or an exported folder")
    parser.add_argument("--prompt-file", help="read the prompt from this file ('-': standard input)")
    parser.add_argument("--data", help="processed data dir with codes and vocab (default: the run's, or the "
                                       "exported folder's own)")
    parser.add_argument("--max-tokens", type=int, default=100, help="BPE tokens to generate per sample")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: no nucleus cut")
    parser.add_argument("--greedy", action="store_true", help="the most likely token each time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-at-eol", action="store_true", help="end each sample at its first line end")
    parser.add_argument("--context", type=int, default=0, help="context window in tokens (default: the run's bptt)")
    parser.add_argument("--no-cache", action="store_true", help="a full forward per token (no key/value cache)")
    parser.add_argument("--device", default="auto")
    add_plugins_option(parser)
    args = parser.parse_args(argv)
    try:
        import_plugins(args.plugins)
        if args.max_tokens < 1 or args.num_samples < 1 or args.context < 0:
            raise ValueError("--max-tokens and --num-samples must be >= 1, --context >= 0 (0: the run's bptt)")
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.greedy)
        prompt = _read_prompt(args)
        device = resolve_device(args.device, "--device")
        own_text = Path(args.checkpoint).is_dir()  # an exported folder carries its vocab and codes
        trained = load_trained(args.checkpoint, args.data or (args.checkpoint if own_text else None))
        codec = trained.codec()
        ids = codec.encode(prompt)
        window = args.context or trained.cfg.data.bptt
        samples = generate(trained.model.to(device), ids, args.max_tokens, sampling, args.seed, args.num_samples,
                           window, not args.no_cache, codec.dictionary.eos if args.stop_at_eol else None)
    except USER_ERRORS as e:
        return fail(prog, e)
    for i, continuation in enumerate(samples):
        if args.num_samples > 1:
            print(f"# sample {i + 1}")
        print(codec.decode(ids + continuation))
    return 0

