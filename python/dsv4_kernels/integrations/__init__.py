"""Ready-made hookups of ``dsv4_kernels`` into the training code that calls the seeds.

:mod:`.nemo`: :func:`apply_dsv4_kernels_to_nemo` patches NeMo AutoModel's DeepSeek-V4
(and V4.1) layers so that they call this package's kernels; :func:`revert_dsv4_kernels_for_nemo`
(or the returned handle's ``undo()``) puts the originals back. Importing this package never
imports NeMo AutoModel or torch; ``apply`` raises ImportError when they are missing.
"""

from .nemo import NemoKernelPatch, apply_dsv4_kernels_to_nemo, revert_dsv4_kernels_for_nemo

__all__ = ["NemoKernelPatch", "apply_dsv4_kernels_to_nemo", "revert_dsv4_kernels_for_nemo"]
