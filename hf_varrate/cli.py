"""The `hf-varrate` command: `calibrate`, `push` and `demo`.

    hf-varrate calibrate --model smollm2-135m-instruct --out my-bases
    hf-varrate push my-bases your-name/smollm2-135m-instruct-varrate [--private] [--revision BRANCH]
    hf-varrate demo ...
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        from .calibration.__main__ import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv and argv[0] == "demo":
        from .demo import main as demo_main  # written separately; imported only when asked for

        return demo_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    if args.command == "push":
        return push(args)
    build_parser().print_help()
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-varrate", description="VarRate KV-cache compression for transformers")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("calibrate", help="build bases for a model (same as python -m hf_varrate.calibration)",
                        add_help=False)
    push_parser = commands.add_parser("push", help="upload a bases folder to the Hugging Face Hub")
    push_parser.add_argument("folder", help="folder holding bases.safetensors, config.json and README.md")
    push_parser.add_argument("repo_id", help="Hub repo to create or update, e.g. your-name/model-varrate")
    push_parser.add_argument("--private", action="store_true", help="create the repo private")
    push_parser.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    push_parser.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    push_parser.add_argument("--message", default=None, help="commit message")
    commands.add_parser("demo", help="run the demo", add_help=False)
    return parser


def push(args) -> int:
    from .bases import push_folder

    info = push_folder(args.folder, args.repo_id, private=args.private or None, revision=args.revision,
                       token=args.token, commit_message=args.message)
    print(f"pushed {args.folder} to {args.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
