"""isotrain inside trainers that own the loop: Hugging Face ``Trainer`` and Lightning.

``isotrain.integrations.transformers`` (``GuardedTrainer``) and
``isotrain.integrations.lightning`` (``GuardCallback``) each import their framework when
imported themselves, never before: ``import isotrain`` imports neither. They are optional
extras: ``pip install 'isotrain[transformers]'`` / ``'isotrain[lightning]'``.
"""

__all__: list[str] = []
