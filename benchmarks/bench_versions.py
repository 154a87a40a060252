"""Before / after: the prefill overhead of this checkout's codec against an earlier commit's.

Each version runs in its own subprocess (alternating, `--rounds` times): a plain prefill with its
inputs captured, `--replays` codec replays through that version's `VarRateCache.update`, a second
plain prefill; overhead = median codec seconds / median plain seconds, both measured in that process.
The earlier commit is checked out with `git worktree` into a temporary folder and its package alone
(hf_varrate/) is put first on PYTHONPATH (the benchmark helpers and evaluation/'s capture toolkit come
from this checkout).

    python benchmarks/bench_versions.py --before 637449c      # the codec as first written
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import common

CHILD = r"""
import json, statistics, sys, torch
sys.path.insert(0, {bench!r})
torch.set_num_threads({threads})
import common, hf_varrate
from hf_varrate import Bases, VarRateCache, binding
hook = getattr(binding, "prefill_hook", None) or binding._capture_prefill  # the hook's name before it was public
model, tok = common.load({model!r})
try:
    bases, bases_name = common.bases_for({model!r}, model)
except ValueError:  # an earlier version cannot read today's shipped bases (spectrum tensors); same rank R = D
    bases, bases_name = Bases.identity(model.config), "identity"
ids = common.document_ids(tok, {length})
captured, plain = common.capture_prefill(model, ids)
def make():
    try:
        return VarRateCache(bases, model_config=model.config, model=model)
    except TypeError:  # versions before model= existed
        return VarRateCache(bases, model_config=model.config)
codec = [common.replay_into(make(), model, captured, hook=hook) for _ in range({replays})]
_, plain2 = common.capture_prefill(model, ids)
print(json.dumps({{"package": hf_varrate.__file__, "bases": bases_name, "plain": [plain, plain2], "codec": codec}}))
"""


def run(version_path: str | None, args) -> dict:
    env = dict(os.environ)
    if version_path:
        env["PYTHONPATH"] = version_path + os.pathsep + env.get("PYTHONPATH", "")
    code = CHILD.format(bench=str(common.REPO / "benchmarks"), threads=args.threads, model=args.model,
                        length=args.length, replays=args.replays)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the {'earlier' if version_path else 'current'} version's process failed:\n{out.stderr}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["overhead"] = statistics.median(result["codec"]) / statistics.median(result["plain"])
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="637449c", help="commit of the earlier version")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="versions")
    args = parser.parse_args(argv)
    env = common.environment()
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree, package = os.path.join(tmp, "before"), os.path.join(tmp, "package")
        subprocess.run(["git", "-C", str(common.REPO), "worktree", "add", "-q", "--detach", tree, args.before],
                       check=True)
        os.makedirs(package)
        os.symlink(os.path.join(tree, "hf_varrate"), os.path.join(package, "hf_varrate"))  # not its evaluation/
        try:
            for round_ in range(args.rounds):
                for name, path in (("before", package), ("after", None)):
                    runs[name].append(run(path, args))
                    common.log(f"round {round_} {name}: overhead {runs[name][-1]['overhead']:.1%}")
        finally:
            subprocess.run(["git", "-C", str(common.REPO), "worktree", "remove", "--force", tree], check=True)
    rows = []
    for name, items in runs.items():
        codec = [x for r in items for x in r["codec"]]
        plain = [x for r in items for x in r["plain"]]
        rows.append([name, args.before if name == "before" else "this checkout", statistics.median(plain),
                     statistics.median(codec), ", ".join(f"{100 * r['overhead']:.1f}%" for r in items)])
    md = (f"## Prefill overhead before / after ({args.model} fp32, {args.length} tokens, {args.threads} thread(s))\n\n"
          + common.table(["version", "commit", "plain prefill s (median)", "codec s (median)",
                          "overhead per process"], rows)
          + f"\n\nVersions alternate in fresh processes ({args.rounds} rounds x {args.replays} replays); load average "
          f"at start {tuple(round(x, 1) for x in env['load_average'])}; bases: before "
          f"{runs['before'][0].get('bases')}, after {runs['after'][0].get('bases')}.\n"
          f"Command: python benchmarks/bench_versions.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
          + "\n")
    common.write_results(args.out, {"env": env, "args": vars(args), "runs": runs}, md)


if __name__ == "__main__":
    main()
