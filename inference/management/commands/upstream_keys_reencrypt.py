"""``manage.py upstream_keys_reencrypt``: every stored upstream key under the newest encryption key.

Rotation (docs/operations.md): put a new Fernet key first in UPSTREAM_KEY_ENCRYPTION_KEYS,
keep the old one after it, restart, run this command, then remove the old key. Each key is
re-encrypted under its row lock, so a concurrent update of the key pool's counters is
never lost. Keys that no configured encryption key can read are listed and left as they
are; the command then exits non-zero.
"""

from __future__ import annotations

from django.core.management.base import CommandError
from django.db import transaction

from inference.models import UpstreamKey
from inference.secrets import SecretUnreadable, reencrypt
from ragsite.commands import DatabaseCommand


class Command(DatabaseCommand):
    help = "Re-encrypt every upstream key with the first key of UPSTREAM_KEY_ENCRYPTION_KEYS (MultiFernet.rotate)."

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true", help="Check every key decrypts; change nothing.")

    def handle(self, *args, dry_run: bool = False, **options):
        rotated = 0
        unreadable: list[str] = []
        for pk in UpstreamKey.objects.order_by("pk").values_list("pk", flat=True):
            with transaction.atomic():
                key = UpstreamKey.objects.select_for_update().select_related("provider").filter(pk=pk).first()
                if key is None:  # deleted meanwhile
                    continue
                try:
                    token = reencrypt(key.secret_encrypted)
                except SecretUnreadable:
                    unreadable.append(f"{key.provider} / {key.label} (id {key.pk}, …{key.last_four})")
                    continue
                if not dry_run:
                    key.secret_encrypted = token
                    key.save(update_fields=["secret_encrypted"])
                rotated += 1
        verb = "would re-encrypt" if dry_run else "re-encrypted"
        self.stdout.write(f"{verb} {rotated} upstream key{'s' if rotated != 1 else ''}")
        if unreadable:
            one = len(unreadable) == 1
            raise CommandError(
                f"{len(unreadable)} upstream key{'' if one else 's'} could not be decrypted with any of "
                f"UPSTREAM_KEY_ENCRYPTION_KEYS and {'was' if one else 'were'} left unchanged (add the encryption "
                f"key {'it was' if one else 'they were'} stored with, or enter {'it' if one else 'them'} again in "
                "the admin): " + "; ".join(unreadable)
            )
