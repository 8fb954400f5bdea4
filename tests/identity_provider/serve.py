"""``python -m tests.identity_provider.serve PORT DATA_DIR``: the test OpenID provider on
127.0.0.1:PORT, its database and signing key in DATA_DIR (made on first start)."""

import os
import sys
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


def main(port: int, data: Path) -> None:
    data.mkdir(parents=True, exist_ok=True)
    key = data / "signing-key.pem"
    if not key.exists():
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        key.write_bytes(
            private.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    os.environ.update(
        DJANGO_SETTINGS_MODULE="tests.identity_provider.settings",
        IDP_DATA_DIR=str(data),
        IDP_ISSUER=f"http://127.0.0.1:{port}/o",
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    call_command("runserver", f"127.0.0.1:{port}", use_reloader=False, use_threading=True, skip_checks=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
