"""The model card (README.md) of a bases artifact, rendered from the template shipped as package data."""

from __future__ import annotations

import os
from importlib import resources
from string import Template

from .bases_checks import BUILD_HINT, WEIGHTS_NAME

CARD_TAGS = ["hf_varrate", "varrate", "kv-cache", "kv-cache-compression", "long-context"]


def render_card(metadata: dict, bases_ref: str | None = None, spectrum: bool = False) -> str:
    """The README.md model card of a bases artifact, from the template shipped as package data;
    `spectrum`: whether the tensor file also holds the calibration singular values."""
    from huggingface_hub import ModelCardData

    model_id = metadata.get("model_id")
    hub_id = model_id if isinstance(model_id, str) and _is_repo_id(model_id) else None
    card_data = ModelCardData(base_model=hub_id, library_name="hf_varrate", license=metadata.get("license"),
                              tags=CARD_TAGS)
    template = Template(resources.files("hf_varrate").joinpath("hub_assets/model_card.md").read_text("utf-8"))
    return template.safe_substitute(
        card_data=card_data.to_yaml(),
        model_name=model_id or "<model>",
        bases_ref=bases_ref or metadata.get("bases_ref") or "path/or/repo-id/of/these/bases",
        shape_table=_shape_table(metadata, spectrum),
        calibration_section=_calibration_section(metadata),
        quality_section=_quality_section(metadata),
        build_command=metadata.get("build_command") or BUILD_HINT,
    )


def _shape_table(meta: dict, spectrum: bool = False) -> str:
    sha = (meta.get("sha256") or {}).get(WEIGHTS_NAME, "(written on save)")
    rows = [
        ("model", f"`{meta.get('model_id')}`" + (f" ({meta['model_revision']})" if meta.get("model_revision") else "")),
        ("layers; compressed (full attention)", f"{meta.get('num_layers')}; {meta.get('compressed_layers')}"),
        ("KV heads H, head dim d, width D = 2Hd", f"{meta.get('num_kv_heads')}, {meta.get('head_dim')}, "
                                                   f"{meta.get('width')}"),
        ("basis rank R", meta.get("rank")),
        ("anchor stride, exact window, nearest anchors", f"{meta.get('stride')}, {meta.get('window')}, "
                                                         f"{meta.get('n_anchors')}"),
        (f"tensors in {WEIGHTS_NAME}", f"`layers.<i>` [R, D] {meta.get('dtype')} (the basis V of layer i)"
                                        + ("; `spectrum.<i>` [R] float32 (its calibration singular values, "
                                           "descending, one per row of V)" if spectrum else "")),
        (f"sha256 of {WEIGHTS_NAME}", f"`{sha}`"),
        ("hf_varrate version", meta.get("library_version")),
    ]
    return "\n".join(f"| {name} | {value} |" for name, value in rows)


def _calibration_section(meta: dict) -> str:
    if meta.get("calibration") == "identity":
        return "None: identity bases (every layer's V is the identity), a baseline."
    lines = [
        f"- data: {meta.get('calibration', 'not recorded')}",
        f"- contexts: {meta.get('num_contexts')} x {meta.get('context_length')} tokens, seed {meta.get('seed')}",
        f"- residual vectors per layer: {meta.get('num_samples')} (the coded tokens, as the cache codes them)",
        "- method: fp64 second moment of the residuals per layer, top-R eigenvectors (= right singular "
        "vectors), sign fixed so each row's largest-magnitude entry is positive",
    ]
    if meta.get("calibration_seconds") is not None:
        lines.append(f"- time: {meta['calibration_seconds']:.1f} s on {meta.get('calibration_machine', 'CPU')}")
    return "\n".join(lines)


def _quality_section(meta: dict) -> str:
    quality = meta.get("quality")
    if not quality:
        return "Not measured for this artifact."
    head = (
        f"Relative reconstruction error of the codec at budget {quality['budget']} on held-out text "
        f"({quality['data']}; {quality['num_contexts']} contexts x {quality['context_length']} tokens, none of it "
        f"used for calibration): ||K^ - K||_F / ||K||_F over the coded (non-exact) tokens of each compressed "
        f"layer, then the mean over layers; the same for V. The exact K/V come from a `DynamicCache` on the same "
        f"input. Lower is better.\n\n"
        "| basis | keys | values | footprint (fraction of full K/V) |\n|---|---|---|---|"
    )
    rows = [f"| {label} | {quality[key]['keys']:.4f} | {quality[key]['values']:.4f} | "
            f"{quality[key]['footprint']:.4f} |"
            for key, label in (("calibrated", "these bases"), ("identity", "identity basis (no calibration)"))
            if key in quality]
    return "\n".join([head, *rows])


def _is_repo_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not os.path.isabs(name) and not name.startswith(".")
