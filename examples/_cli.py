"""What the example scripts share: the options that pick the model and pin torch's CPU threads.

Run the examples as scripts (``python examples/<name>.py``): Python puts this folder on the path.
"""

from __future__ import annotations

import argparse

import torch

from branchwise import HFBackend


def example_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the options every example takes: `--model` and `--threads`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: the embedded model)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 on a busy shared CPU)"
    )
    return parser


def load_backend(args: argparse.Namespace) -> HFBackend:
    """Pin torch's threads when asked, then load `--model` (the embedded model by default)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return HFBackend(args.model)
