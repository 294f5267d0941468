"""Streaming DiLoCo where users already train: callbacks over learner/api.py's DilocoSync for
Hugging Face Trainer (huggingface.py) and PyTorch Lightning (lightning.py). Each needs its
optional extra: pip install 'decoupled-diloco[hf]' or 'decoupled-diloco[lightning]'."""
