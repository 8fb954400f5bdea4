"""django-oauth-toolkit's validator, with a groups claim and the faults the tests ask for."""

import json
import time

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwcrypto import jwk, jwt
from oauth2_provider.oauth2_validators import OAuth2Validator

from tests.identity_provider.control import faults


class FaultInjectingValidator(OAuth2Validator):
    # The groups claim comes with the openid scope, as Entra ID and Okta send it when the
    # application is set to: no scope of its own to ask for.
    oidc_claim_scope = {**OAuth2Validator.oidc_claim_scope, "groups": "openid"}

    def get_additional_claims(self, request):
        user = request.user
        return {
            "email": user.email,
            "name": user.get_full_name() or user.username,
            "given_name": user.first_name,
            "family_name": user.last_name,
            "preferred_username": user.username,
            "groups": sorted(user.groups.values_list("name", flat=True)),
        }

    def get_id_token_dictionary(self, token, token_handler, request):
        claims, expiration_time = super().get_id_token_dictionary(token, token_handler, request)
        if faults().get("expired"):
            claims["exp"] = int(time.time()) - 3600
        return claims, expiration_time

    def finalize_id_token(self, id_token, token, token_handler, request):
        wrong = faults()
        if wrong.get("audience"):
            id_token["aud"] = wrong["audience"]
        serialized = super().finalize_id_token(id_token, token, token_handler, request)
        if not wrong.get("forged"):
            return serialized
        # The same header (its kid included) and claims, signed by a key the provider never published.
        issued = jwt.JWT(jwt=serialized, expected_type="JWS")
        header = json.loads(issued.token.objects["protected"])
        claims = json.loads(issued.token.objects["payload"])
        pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        forged = jwt.JWT(header=json.dumps(header), claims=json.dumps(claims))
        forged.make_signed_token(jwk.JWK.from_pem(pem))
        return forged.serialize()
