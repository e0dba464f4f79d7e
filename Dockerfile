# memplan planner service image (API and workers). CPU-only torch: the service never runs models.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4"
COPY pyproject.toml README.md ./
COPY client ./client
COPY agent ./agent
COPY planner_service ./planner_service
COPY memplan ./memplan
COPY migrations ./migrations
RUN pip install . && useradd --create-home memplan
USER memplan
EXPOSE 8000
CMD ["memplan", "serve", "--host", "0.0.0.0", "--port", "8000"]
