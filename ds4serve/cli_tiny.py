"""``ds4serve tiny``: train and evaluate the bundled tiny DS4V model (kept apart from ``cli.py``,
whose other commands serve and benchmark)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_tiny_parser(sub: argparse._SubParsersAction) -> None:
    tiny = sub.add_parser("tiny", help="the bundled tiny DS4V model: train it, evaluate it")
    tsub = tiny.add_subparsers(dest="tiny_command", required=True)
    tr = tsub.add_parser("train", help="train the tiny DS4V model on CPU (synthetic shapes, math, reversal)")
    tr.add_argument("--out", type=Path, default=Path("models/ds4v-tiny"))
    tr.add_argument("--steps", type=int, default=6000)
    tr.add_argument("--batch", type=int, default=48)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=2, help="CPU threads (fixed for reproducibility)")
    tr.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    tr.add_argument("--init", type=Path, default=None,
                    help="continue from this tiny checkpoint (stage 2 only: free-hand pictures, reworded questions)")
    tr.add_argument("--easy-vision-steps", type=int, default=1000,
                    help="stage 2a's first part: the tower on large, centred free-hand shapes")
    tr.add_argument("--free-vision-steps", type=int, default=4000,
                    help="stage 2a: the vision tower on free-hand pictures with per-token labels")
    tr.add_argument("--robust-steps", type=int, default=1300, help="stage 2b steps (0: the original recipe only)")
    tr.add_argument("--robust-lr", type=float, default=5e-4)
    tr.add_argument("--free-share", type=float, default=0.8, help="share of stage 2 pictures drawn free hand")
    dr = tsub.add_parser("train-drafter", help="train a DSpark drafter for the tiny model on its own outputs (CPU)")
    dr.add_argument("--model", type=Path, default=Path("models/ds4v-tiny"))
    dr.add_argument("--out", type=Path, default=None,
                    help="folder for drafter.safetensors + config.json with the dspark_* keys (default: --model; "
                         "another folder gets links to the model's files, a whole checkpoint)")
    dr.add_argument("--steps", type=int, default=5000)
    dr.add_argument("--stages", type=int, default=1, help="DSpark stages (the release has 3)")
    dr.add_argument("--seed", type=int, default=0)
    dr.add_argument("--threads", type=int, default=2, help="CPU threads (fixed for reproducibility)")
    dr.add_argument("--time-limit", type=float, default=None,
                    help="stop after this many seconds (data generation included)")
    dr.add_argument("--bench-prompts", type=int, default=192,
                    help="prompts shaped like `bench spec`'s (a random phrase repeated) to self-distil on")
    dr.add_argument("--task-prompts", type=int, default=64, help="chat prompts of the tiny model's text tasks")
    ev = tsub.add_parser("eval", help="exact-match accuracy on a held-out set through the real engine")
    ev.add_argument("--model", type=Path, default=None)
    ev.add_argument("--set", dest="eval_set", choices=("original", "wild", "both"), default="original",
                    help="original: the training renderer's pictures; wild: an independent renderer (any size, "
                         "background, position, outlines, JPEG) and paraphrased questions; both: two tables")
    ev.add_argument("--n", type=int, default=500, help="questions per set")
    ev.add_argument("--in-flight", type=int, default=16)
    ev.add_argument("--seed", type=int, default=None,
                    help="held-out data seed (default: 2 for the original set, 1717 for the wild one; training "
                         "uses other seeds)")
    ev.add_argument("--threads", type=int, default=None)


def run_tiny(args) -> int:
    import torch

    if args.tiny_command == "train":
        from .tiny.train import TrainSettings, train

        torch.set_num_threads(args.threads)
        summary = train(TrainSettings(
            out=args.out, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, time_limit_s=args.time_limit,
            init=args.init, easy_vision_steps=args.easy_vision_steps, free_vision_steps=args.free_vision_steps,
            robust_steps=args.robust_steps,
            robust_lr=args.robust_lr, free_share=args.free_share))
        print(f"trained {args.out} in {summary['elapsed_s']:.0f} s ({summary['steps']} steps)")
        return 0
    if args.tiny_command == "train-drafter":
        from .tiny.train_drafter import DrafterSettings, train_drafter

        torch.set_num_threads(args.threads)
        summary = train_drafter(DrafterSettings(model=args.model, out=args.out or args.model, steps=args.steps,
                                                stages=args.stages, seed=args.seed, time_limit_s=args.time_limit,
                                                bench_prompts=args.bench_prompts, task_prompts=args.task_prompts))
        print(f"trained the drafter in {summary['elapsed_s']:.0f} s ({summary['steps']} steps)")
        return 0
    from .tiny.evaluate import HELD_OUT_SEED, evaluate
    from .tiny.random_model import default_model
    from .tiny.wild_eval import WILD_SEED, evaluate_wild

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or default_model()[0]
    llm = None
    if args.eval_set == "both":  # one loaded model serves both sets
        from .llm import LLM

        llm = LLM(model, max_seqs=args.in_flight, max_model_len=512)
    if args.eval_set in ("original", "both"):
        evaluate(model, n=args.n, in_flight=args.in_flight, seed=_seed(args.seed, HELD_OUT_SEED), llm=llm)
    if args.eval_set == "both":
        print()
    if args.eval_set in ("wild", "both"):
        evaluate_wild(model, n=args.n, in_flight=args.in_flight, seed=_seed(args.seed, WILD_SEED), llm=llm)
    return 0


def _seed(given: int | None, default: int) -> int:
    return default if given is None else given
