"""dflash_train: train a DFlash block-diffusion drafter for a frozen target LLM.

Pure-numpy modules (importable without torch): config, anchors, masks, loss,
store, data (the ShareGPT parts).  Torch modules: drafter, target, regenerate,
train, export, checkpoint, pipeline.
"""

__version__ = "0.1.0"
