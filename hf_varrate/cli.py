"""The `hf-varrate` command: `calibrate`, `measure-layers`, `push` and `demo`.

    hf-varrate calibrate --model smollm2-135m-instruct --out my-bases
    hf-varrate measure-layers my-bases --model smollm2-135m-instruct [--budgets 0.1,0.2]
    hf-varrate push my-bases your-name/smollm2-135m-instruct-varrate [--private] [--revision BRANCH]
        [--subfolder DIR] [--create-pr]
    hf-varrate demo [--storage compact] [--question "..."]
    hf-varrate --version

`calibrate`, `measure-layers` and `demo` own their arguments (`hf-varrate calibrate --help`); they are imported only
when asked for, so `hf-varrate push` and `--help` do not load torch's model code.
"""

from __future__ import annotations

import argparse
import sys

from .version import __version__

PROG = "hf-varrate"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        from .calibration.__main__ import main as calibrate_main

        return calibrate_main(argv[1:], prog=f"{PROG} calibrate")
    if argv and argv[0] == "measure-layers":
        from .calibration.sensitivity import main as measure_main

        return measure_main(argv[1:], prog=f"{PROG} measure-layers")
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:], prog=f"{PROG} demo") or 0
    args = build_parser().parse_args(argv)
    if args.command == "push":
        return push(args)
    build_parser().print_help()
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="VarRate KV-cache compression for transformers")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{calibrate,measure-layers,push,demo}")
    commands.add_parser("calibrate", help="build bases for a model (hf-varrate calibrate --help)", add_help=False)
    commands.add_parser("measure-layers", help="measure each layer's sensitivity into a bases folder, for "
                        "layer_budgets='measured' (hf-varrate measure-layers --help)", add_help=False)
    push_parser = commands.add_parser("push", help="upload a bases folder to the Hugging Face Hub")
    push_parser.add_argument("folder", help="folder holding bases.safetensors, config.json and README.md")
    push_parser.add_argument("repo_id", help="Hub repo to create or update, e.g. your-name/model-varrate")
    push_parser.add_argument("--private", action="store_true", help="create the repo private")
    push_parser.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    push_parser.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    push_parser.add_argument("--message", default=None, help="commit message")
    push_parser.add_argument("--subfolder", default=None, help="folder of the repo to put the bases in")
    push_parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    commands.add_parser("demo", help="compress a document once, answer questions from it (hf-varrate demo --help)",
                        add_help=False)
    return parser


def push(args) -> int:
    from .bases import push_folder

    info = push_folder(args.folder, args.repo_id, subfolder=args.subfolder, private=args.private or None,
                       revision=args.revision, token=args.token, commit_message=args.message, create_pr=args.create_pr)
    print(f"pushed {args.folder} to {args.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
