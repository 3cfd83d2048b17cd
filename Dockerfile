# One image for the control plane and the agents (CPU build of torch; GPU hosts use a CUDA base
# image and `make setup TORCH_SPEC=...`).
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY contract contract
COPY server server
COPY agent agent
COPY evenflow evenflow
COPY frontend frontend
COPY migrations migrations
RUN pip install --no-cache-dir .
EXPOSE 8000
CMD ["evenflow", "server", "--host", "0.0.0.0", "--port", "8000"]
