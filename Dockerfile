# Two images for tierflow's Python services, one target each:
#
#   service  the queue service, the gateway, the OpenAI-compatible service (openai_api/) and the
#            init step that writes Envoy's descriptor set.
#            No torch, no transformers: these processes never run the model (the queue service
#            reads its tokenizer through tierflow.catalogue), and leaving the model stack out
#            makes the image a fraction of the worker's size.
#   worker   the workers. torch comes from PyPI, whose Linux x86_64 wheels carry CUDA: compose
#            reserves one GPU per worker.
#
# docker-compose.yml builds both (tierflow-service:local, tierflow-worker:local); by hand:
#   docker build --target service -t tierflow-service:local .
#   docker build --target worker -t tierflow-worker:local .
# Each image's dependencies come from docker/requirements.py, which reads them from
# pyproject.toml (why there, and not from extras, is said there).
FROM python:3.11-slim-bookworm AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TIERFLOW_LOG_FORMAT=json \
    TIERFLOW_CACHE=/models/tierflow \
    HF_HOME=/models/hf

WORKDIR /app

# Not root. /models (model directories, the Hugging Face cache, tierflow's converted models)
# and /descriptors (Envoy's descriptor set) are mount points for named volumes, which start
# with this ownership.
RUN useradd --create-home --uid 10001 tierflow \
    && mkdir -p /models /descriptors \
    && chown tierflow:tierflow /models /descriptors

# The dependency lists first, so that a code change rebuilds only the layers below the install
# and does not download torch again.
COPY pyproject.toml README.md ./
COPY docker/requirements.py docker/


FROM base AS service
RUN python docker/requirements.py service > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
# protos/ and config/ travel too: the descriptor-set step compiles protos/, and config/ holds
# the default tiers and the demo keys (mount real ones over it).
COPY tierflow/ tierflow/
COPY queue_service/ queue_service/
COPY gateway/ gateway/
COPY openai_api/ openai_api/
COPY launch/ launch/
COPY protos/ protos/
COPY config/ config/
RUN pip install --no-deps .
USER tierflow
EXPOSE 50051 50052 8000
CMD ["python", "-m", "queue_service.server", "--help"]


FROM base AS worker
RUN python docker/requirements.py worker > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY tierflow/ tierflow/
COPY worker/ worker/
COPY config/ config/
RUN pip install --no-deps .
USER tierflow
CMD ["python", "-m", "worker.process", "--help"]
