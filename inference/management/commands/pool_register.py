"""``manage.py pool_register``: record the GPU pool of the ``GPU_POOL_*`` settings as a provider.

For engine servers run outside ``manage.py up`` (compose's ``vllm-gpuN`` services): their
base URLs come from ``GPU_POOL_DEVICE_URLS``. ``up`` registers the servers it starts itself.
"""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import CommandError

from inference.serving import PoolConfig, pool_register
from ragsite.commands import DatabaseCommand


class Command(DatabaseCommand):
    help = "Create or update the GPU pool's provider (and a default route if none) from the GPU_POOL_* settings."

    def handle(self, *args, **options):
        if not settings.GPU_POOL_MODEL:
            raise CommandError("GPU_POOL_MODEL is empty: there is no pool to register")
        if not settings.GPU_POOL_DEVICE_URLS:
            raise CommandError("GPU_POOL_DEVICE_URLS is empty: list the engine servers' base URLs, comma-separated")
        provider = pool_register(PoolConfig.from_settings(), list(settings.GPU_POOL_DEVICE_URLS))
        devices = ", ".join(provider.devices)
        self.stdout.write(
            f"pool {provider.name}: {provider.model} ({provider.speculative_method}, k={provider.speculative_k}) "
            f"on {devices}"
        )
