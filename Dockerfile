# GPU image for the rank side: NGC PyTorch ships CUDA, cuDNN, NCCL, Transformer Engine and NVIDIA apex, so
# nothing GPU-specific is built here. Use it as cluster.container_image (pyxis/enroot) after pushing it.
#   docker build -t megatron-launcher:latest .
# Its Transformer Engine is older than 2.10, which Megatron-FSDP needs for fused gradient accumulation
# (mcore_fsdp_adapter.py): models/builder.py then leaves that fusion off for parallel.megatron_fsdp runs;
# a newer image with TE >= 2.10 turns it on by itself.
FROM nvcr.io/nvidia/pytorch:25.09-py3

WORKDIR /opt/launcher
COPY . /opt/launcher

# Keep the container's own torch and Transformer Engine: pin them to what is installed, then add the launcher,
# megatron-core and the logging/tokenizer packages. (Never `pip install apex`: that PyPI name is an unrelated
# package; NVIDIA apex comes with this image, or from a source build of github.com/NVIDIA/apex.)
RUN pip freeze | grep -iE '^(torch|transformer[-_]engine|triton)==' > /tmp/container-pins.txt \
 && pip install --no-cache-dir -c /tmp/container-pins.txt -e '.[train]' \
 && python -c "import megatron.core, transformer_engine, launcher; print('ok')"

# No CUDA_DEVICE_MAX_CONNECTIONS here: each job's env.sh sets or unsets it from its own layout
# (launcher/core/cuda_env.py; Megatron-FSDP refuses 1, the MoE all-to-all overlap needs more than 1).
ENV PYTHONUNBUFFERED=1

# Run as an unprivileged user (uid 10001; Ubuntu-based NGC images already have uid 1000). Under pyxis/enroot the
# job runs as the submitting user anyway; this keeps `docker run` from defaulting to root. Caches (Triton,
# torch extensions) go to the user's home; checkpoints and bundles go to mounted directories.
RUN useradd --create-home --uid 10001 --shell /bin/bash launcher
USER launcher
ENV HOME=/home/launcher
