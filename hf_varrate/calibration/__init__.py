"""Training-free calibration of VarRate bases (paper Section 3.1): residuals through hooks, streaming PCA.

    from hf_varrate.calibration import build_contexts, calibrate, load_texts
    texts = load_texts()                                  # local Wikipedia extracts, calibration split
    contexts = build_contexts(tokenizer, texts.documents, num_contexts=6, context_length=2048)
    bases = calibrate(model, contexts, calibration=texts.name)
    bases.save_pretrained("my-bases")

Command line: `python -m hf_varrate.calibration --model smollm2-135m-instruct --out my-bases`; on several
processes, the same under `torchrun --nproc_per_node N -m ...` (each process codes its share of the contexts).
"""

from .calibrate import DEFAULT_RANK, calibrate
from .collect import ResidualSettings, collect_residuals, layer_residuals, residual_hooks
from .contexts import build_contexts
from .distributed import is_main_process
from .evaluate import ReconstructionError, reconstruction_error
from .pca import SecondMoments, orient, principal_components
from .texts import TextSource, load_texts

__all__ = [
    "DEFAULT_RANK", "ReconstructionError", "ResidualSettings", "SecondMoments", "TextSource", "build_contexts",
    "calibrate", "collect_residuals", "is_main_process", "layer_residuals", "load_texts", "orient",
    "principal_components", "reconstruction_error", "residual_hooks",
]
