# pd-router image, built from the repository root:
#
#   docker build -f examples/router.Dockerfile -t registry.example.com/pd-router:0.1.0 .
#
# Used by docker-compose.yml (build:) and, once pushed, by kubernetes/pd-router.yaml.
FROM python:3.11-slim

COPY pyproject.toml setup.cfg README.md /src/
COPY pd_router /src/pd_router
# With the tracing extra: OTEL_EXPORTER_OTLP_ENDPOINT (or --otlp-traces-endpoint) turns
# OpenTelemetry tracing on without another image.
RUN pip install --no-cache-dir '/src[tracing]' && rm -rf /src

# Unprivileged; the router writes nothing to disk, so a read-only root filesystem works.
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["pd-router"]
CMD ["--help"]
