# The ragsite image: web (gunicorn + uvicorn workers), Celery workers, beat and
# one-shot management commands all run from it (see docker-compose.yml).
#
#   docker build -t ragsite .
#   docker run --env-file .env -p 8000:8000 ragsite
#
# DATABASE_URL and REDIS_URL must be set at run time: without them settings start the
# embedded PostgreSQL/Redis, which is for a developer's machine, not for a container.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    DJANGO_SETTINGS_MODULE=ragsite.settings \
    RAGSITE_VAR_DIR=/app/var

# The processes run as this unprivileged user; the code stays owned by root (read-only
# to them) and only var/ (static files, uploads, beat schedule) is theirs.
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home --shell /usr/sbin/nologin app

# Dependencies first, so that a code change does not reinstall them. Every pinned
# package ships manylinux wheels, so no compiler is needed.
COPY requirements.txt /tmp/requirements.txt
RUN python -m venv "$VIRTUAL_ENV" \
 && pip install -r /tmp/requirements.txt \
 && python -c "from uvicorn_worker import UvicornWorker" \
 && rm /tmp/requirements.txt

WORKDIR /app
COPY . /app
# Named volumes mounted on these folders start out with the image's ownership, so the
# app user can write uploads (media/), the beat schedule (beat/) and the processes' metrics (metrics/).
RUN python -m compileall -q /app \
 && mkdir -p /app/var/static /app/var/media /app/var/beat /app/var/metrics \
 && chown -R app:app /app/var

USER app

# Static files into $RAGSITE_VAR_DIR/static (served by ServeStatic). The URLs below are
# only parsed at import, never connected to; setting them keeps settings from starting
# the embedded servers, and the throwaway key from writing var/secret_key.
RUN DATABASE_URL=postgresql://build@localhost/build \
    REDIS_URL=redis://localhost:6379/0 \
    SECRET_KEY=build-only-collectstatic-key-not-used-at-run-time \
    python manage.py collectstatic --noinput

EXPOSE 8000

# ASGI for the Server-Sent Events token streams. uvicorn_worker.UvicornWorker replaces
# the deprecated uvicorn.workers.UvicornWorker.
CMD ["gunicorn", "ragsite.asgi:application", "-k", "uvicorn_worker.UvicornWorker", "--bind", "0.0.0.0:8000", "--workers", "2", "--graceful-timeout", "30", "--worker-tmp-dir", "/dev/shm", "--access-logfile", "-"]
