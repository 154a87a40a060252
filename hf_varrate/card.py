"""What an artifact says about itself: the model card (README.md) of a bases artifact or of a saved cache
pushed to the Hub, rendered from the templates shipped as package data, and the string header of its
safetensors file (`tensor_header`: library, kind, format version, model id), so a tensor file found on
its own still says what it is."""

from __future__ import annotations

import os
from importlib import resources
from string import Template

from .bases_checks import BUILD_HINT, WEIGHTS_NAME
from .config import LOW_BUDGET, LOW_BUDGET_KEY
from .codec.layer_budget import recorded_scales
from .version import __version__

CARD_TAGS = ["hf_varrate", "varrate", "kv-cache", "kv-cache-compression", "long-context"]
CACHE_TAGS = [*CARD_TAGS, "compressed-kv-cache"]
UNKNOWN_LICENSE = "other"  # the Hub's value for a license not in its list (the base model's terms apply)


def tensor_header(kind: str, model_id, format_version: int, **extra) -> dict[str, str]:
    """The string metadata of an artifact's safetensors file: `kind` ('bases' or 'cache'), the library and
    its version, the artifact's format version, the model id and `extra` fields (None values left out)."""
    header = {"format": "pt", "library": "hf_varrate", "library_version": __version__, "kind": kind,
              "format_version": str(format_version), "model_id": model_id, **extra}
    return {key: str(value) for key, value in header.items() if value is not None}


def card_data_yaml(model_id, license: str | None, tags: list[str]) -> str:
    """The card's YAML header: base_model (a Hub id only), library_name, license, tags."""
    from huggingface_hub import ModelCardData

    hub_id = model_id if isinstance(model_id, str) and _is_repo_id(model_id) else None
    return ModelCardData(base_model=hub_id, library_name="hf_varrate", license=license or UNKNOWN_LICENSE,
                         tags=tags).to_yaml()


def render_card(metadata: dict, bases_ref: str | None = None, spectrum: bool = False,
                subfolder: str | None = None) -> str:
    """The README.md model card of a bases artifact, from the template shipped as package data;
    `spectrum`: whether the tensor file also holds the calibration singular values; `bases_ref` and
    `subfolder`: where the usage snippet loads them from."""
    model_id = metadata.get("model_id")
    ref = bases_ref or metadata.get("bases_ref") or "path/or/repo-id/of/these/bases"
    template = Template(resources.files("hf_varrate").joinpath("hub_assets/model_card.md").read_text("utf-8"))
    return template.safe_substitute(
        card_data=card_data_yaml(model_id, metadata.get("license"), CARD_TAGS),
        model_name=model_id or "<model>",
        bases_args=f'"{ref}"' + (f', subfolder="{subfolder}"' if subfolder else ""),
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
    measured = meta.get("layer_sensitivity")
    if measured:  # what layer_budgets='measured' codes with
        for budget, scales in sorted(recorded_scales(measured).items(), key=lambda item: float(item[0])):
            rows.append((f"measured per-layer budget scales at {budget}",
                         ", ".join(f"{i}: {s:g}" for i, s in sorted(scales.items()))))
    for preset, settings in sorted((meta.get("presets") or {}).items()):  # chosen for this model, held-out confirmed
        low = settings.get(LOW_BUDGET_KEY, {})
        plain = ", ".join(f"{k}={v!r}" for k, v in sorted(settings.items()) if k != LOW_BUDGET_KEY)
        at_low = ", ".join(f"{k}={v!r}" for k, v in sorted(low.items()))
        text = ", ".join(part for part in (plain, at_low and f"at budget <= {LOW_BUDGET}: {at_low}") if part)
        rows.append((f"preset `{preset}` with these bases",
                     text + " (chosen on a development split, confirmed on a held-out one: docs/accuracy_dev.md)"))
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


def render_cache_card(meta: dict, tensors_sha256: str, repo_id: str, subfolder: str | None = None) -> str:
    """The README.md card of a saved cache pushed to `repo_id` (`meta`: its parsed cache_config.json)."""
    model, bases, config = meta.get("model", {}), meta.get("bases", {}), meta.get("config", {})
    tokens = max((layer.get("prompt_len", 0) + layer.get("appended", 0) for layer in meta.get("layers", [])
                  if isinstance(layer, dict) and layer.get("kind") == "varrate"), default=0)
    rows = [
        ("model", f"`{model.get('model_id')}`"),
        ("bases", f"`{bases.get('source')}`" + (f" (revision {bases['revision']})" if bases.get("revision") else "")
         + (f", commit `{bases['commit']}`" if bases.get("commit") else "")
         + (f", subfolder `{bases['subfolder']}`" if bases.get("subfolder") else "")),
        ("budget, storage", f"{config.get('budget')}, {config.get('storage')}"),
        ("layers (compressed)", f"{model.get('num_layers')} ({len(model.get('compressed_layers', []))})"),
        ("tokens held", tokens or "see cache_config.json"),
        ("sha256 of cache.safetensors", f"`{tensors_sha256}`"),
        ("hf_varrate version", meta.get("library_version")),
    ]
    template = Template(resources.files("hf_varrate").joinpath("hub_assets/cache_card.md").read_text("utf-8"))
    return template.safe_substitute(
        card_data=card_data_yaml(model.get("model_id"), None, CACHE_TAGS),
        model_name=model.get("model_id") or "<model>",
        cache_args=f'"{repo_id}"' + (f', subfolder="{subfolder}"' if subfolder else ""),
        table="\n".join(f"| {name} | {value} |" for name, value in rows),
    )


def _is_repo_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not os.path.isabs(name) and not name.startswith(".")
