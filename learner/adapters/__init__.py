"""Streaming DiLoCo where users already train, over learner/api.py's DilocoSync: callbacks for
Hugging Face Trainer (huggingface.py) and PyTorch Lightning (lightning.py), and torchtitan's
Trainer with a `diloco` config section (torchtitan.py). Each needs its optional extra:
pip install 'decoupled-diloco[hf]', '[lightning]' or '[torchtitan]'."""
