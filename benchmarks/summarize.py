"""One table of the headline numbers from benchmarks/runs/*.json -> benchmarks/runs/SUMMARY.md."""

from __future__ import annotations

import json

from common import RESULTS, table


def load(name: str):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def prefill_rows(data) -> list[list]:
    rows = []
    for r in data["results"]:
        inrun = r["overhead_in_run"]
        rows.append([f"prefill overhead, {r['model']} {r['dtype']} {r['length']}",
                     f"{100 * inrun['median']:.1f}% in run (n={inrun['n']}), {100 * r['overhead_accounted']:.1f}% "
                     f"accounted; codec FLOPs {100 * r['flops_share']:.2f}% of the prefill's"
                     if inrun["n"] else f"{100 * r['overhead_accounted']:.1f}% accounted; codec FLOPs "
                     f"{100 * r['flops_share']:.2f}% of the prefill's"])
    for key, value in data.get("exponents", {}).items():
        rows.append([f"codec time ~ length^k, {key}", f"k = {value:.2f}"])
    return rows


def overhead_rows() -> list[list]:
    rows = []
    for name, label in (("prefill", ""), ("prefill_recommended", "recommended preset, "),
                        ("prefill_recommended_before", "recommended preset, code of bac70c9 (before), ")):
        prefill = load(name)
        if prefill:
            rows += [[row[0].replace("prefill overhead, ", f"prefill overhead, {label}"), *row[1:]]
                     for row in prefill_rows(prefill)]
    versions = load("versions")
    if versions:
        for name in ("before", "after"):
            items = versions["runs"][name]
            text = ", ".join(f"{100 * r['overhead']:.1f}%" for r in items)
            rows.append([f"prefill overhead {name} ({versions['args']['before'] if name == 'before' else 'now'}), "
                         f"{versions['args']['model']} fp32 {versions['args']['length']}", text])
    return rows


def decode_rows() -> list[list]:
    rows = []
    for name in ("decode", "decode_recommended", "decode_bf16", "decode_gemma"):
        decode = load(name)
        if decode:
            rates = decode["tokens_per_second"]
            full = rates["full"]["median"]
            text = ", ".join(f"{name} {r['median']:.2f} ({r['median'] / full:.2f}x)" for name, r in rates.items())
            args = decode["args"]
            rows.append([f"decode tok/s at {args['length']} (vs full), {args['model']} {args['dtype']}, "
                         f"preset {args.get('preset', 'paper')}", text])
    read = load("read")
    if read:
        med, args = read["median"], read["args"]
        text = (f"{med['read_ms_c']:.2f} ms per layer with the C loops ({med['read_ms_torch']:.2f} PyTorch only), of "
                f"which {med['codes_ms_c']:.2f} ({med['codes_ms_torch']:.2f}) reading the codes"
                + (f" (fbgemm's fused 4-bit kernel: {med['fused_codes_ms']:.2f})" if med["fused_codes_ms"] else ""))
        rows.append([f"compact read over the codes at {args['length']}, {args['model']} {args['dtype']}, "
                     f"preset {args['preset']}", text])
    return rows


def memory_rows() -> list[list]:
    rows = []
    memory = load("memory")
    if memory:
        for r in memory["results"]:
            rows.append([f"memory, {r['config']}",
                         f"cache tensors {r['cache_held_bytes'] / 2**20:.1f} MiB; RSS at rest "
                         f"+{r['at_rest_after_prefill'] / 2**20:.0f} MiB; "
                         f"peak prefill +{r['prefill_peak'] / 2**20:.0f} MiB; "
                         f"peak decode +{r['decode_peak'] / 2**20:.0f} MiB"])
    loading = load("load")
    if loading:
        s = loading["seconds"]
        rows.append(["load saved cache + first answer token vs re-prefill",
                     f"{s['load_compact']['median']:.2f} s (compact), {s['load_materialized']['median']:.2f} s "
                     f"(materialized) vs {s['reprefill']['median']:.1f} s: "
                     + ", ".join(f"{k.removeprefix('load_')} {v:.0f}x"
                                 for k, v in loading["speedup_vs_reprefill"].items())])
    return rows


def footprint_rows() -> list[list]:
    rows = []
    footprint = load("footprint")
    if footprint:
        for r in footprint["results"]:
            name = "model dtype" if r["bits"] is None else f"{r['bits']}-bit {r['mode']}"
            rows.append([f"footprint, {r['kv_dtype'].removeprefix('torch.')} K/V, {name}",
                         f"{100 * r['fraction']:.2f}% (mean rank {r['mean_rank']:.0f}, key err {r['key_error']:.3f}, "
                         f"value err {r['value_error']:.3f})"])
    return rows


def main():
    rows = overhead_rows() + decode_rows() + memory_rows() + footprint_rows()
    md = "# Benchmark summary\n\n" + table(["what", "measured"], rows) + (
        "\n\nDetails, noise and commands: prefill.md, decode.md, read.md, memory.md, load.md, footprint.md "
        "beside this file.\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "SUMMARY.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
