# One image for tierflow's Python services: the gateway, the queue service, the workers and the
# OpenAI-compatible service (and the init step that writes Envoy's descriptor set). docker-compose.yml builds it as
# tierflow:local and runs each service with its own command.
#
# torch comes from PyPI, whose Linux x86_64 wheels carry CUDA: the same image runs a worker on a
# GPU (compose reserves one per worker) and the CPU-only services.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TIERFLOW_LOG_FORMAT=json \
    TIERFLOW_CACHE=/models/tierflow \
    HF_HOME=/models/hf

WORKDIR /app

# The dependencies first, read from pyproject.toml alone, so that a code change rebuilds only
# the layers below and does not download torch again.
COPY pyproject.toml README.md ./
RUN python -c "import subprocess, sys, tomllib; \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
subprocess.check_call([sys.executable, '-m', 'pip', 'install', *deps])"

# Then the project itself. protos/ and config/ travel too: the descriptor-set step compiles
# protos/, and config/ holds the default tiers and the demo keys (mount real ones over it).
COPY tierflow/ tierflow/
COPY worker/ worker/
COPY queue_service/ queue_service/
COPY gateway/ gateway/
COPY openai_api/ openai_api/
COPY bench/ bench/
COPY protos/ protos/
COPY config/ config/
RUN pip install --no-deps .

# Not root. /models (model directories, the Hugging Face cache, tierflow's converted models)
# and /descriptors (Envoy's descriptor set) are mount points for named volumes, which start
# with this ownership.
RUN useradd --create-home --uid 10001 tierflow \
    && mkdir -p /models /descriptors \
    && chown tierflow:tierflow /models /descriptors
USER tierflow

EXPOSE 50051 50052 8000
CMD ["python", "-m", "queue_service.server", "--help"]
