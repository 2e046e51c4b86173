FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# CPU wheels keep the image small; GPU nodes run the node agent, not this service.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY forecaster ./forecaster
COPY api ./api
COPY migrations ./migrations
RUN pip install . && useradd --create-home prewarm && mkdir -p /app/models && chown prewarm /app/models
USER prewarm
ENV PREWARM_MODELS_DIR=/app/models PREWARM_ENVIRONMENT=production
ENTRYPOINT ["prewarm"]
CMD ["scheduler"]
