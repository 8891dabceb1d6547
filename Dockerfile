# llmpipe:latest, the image of Prefect's GPU work pool (deployments/gpu-pool.json, prefect.yaml's gpu
# pool): the project with every stage family's extra. From the repository root:
#   docker build -t llmpipe:latest .
# On Linux x86-64, pip's torch==2.13.0 is the CUDA build; the full Debian-based Python image has the C++
# compiler DeepSpeed's JIT-compiled ops need.
ARG PYTHON_IMAGE=python:3.11
FROM ${PYTHON_IMAGE}
WORKDIR /opt/llmpipe
COPY . .
RUN python -m pip install --no-cache-dir -e '.[all]' && PYTHON=python bash scripts/install.sh
ENV TOKENIZERS_PARALLELISM=false
CMD ["llmpipe", "--help"]
