"""Key material: format, hashing with the pepper, constant-time verification."""

import pytest

from tenants.keys import ADMIN_TOKEN, TENANT_KEY, generate_key, hash_key, parse_key, verify_key


def test_generated_keys_have_the_documented_shape_and_are_unique() -> None:
    keys = [generate_key(TENANT_KEY) for _ in range(200)]
    assert len({k.plaintext for k in keys}) == 200
    for key in keys[:5]:
        assert parse_key(key.plaintext) == key.prefix
        assert key.plaintext.startswith(f"tg-{key.prefix}-")
        assert key.secret_hash == hash_key(key.plaintext)
        assert key.plaintext not in key.secret_hash


def test_hash_depends_on_the_pepper(settings: object) -> None:
    key = generate_key()
    settings.TOLLGATE_KEY_PEPPER = "another pepper"
    assert hash_key(key.plaintext) != key.secret_hash
    assert not verify_key(key.plaintext, key.secret_hash)


@pytest.mark.parametrize(
    "presented",
    [
        "",
        "tg-",
        "Bearer x",
        "tg-ABCDEFGH-" + "a" * 40,
        "tg-abcdefgh-" + "a" * 39,
        "tga-abcdefgh-" + "a" * 40,
        "tg-abcdefgh-" + "a" * 40 + "\n",
        "' OR '1'='1",
    ],
)
def test_malformed_or_wrong_kind_keys_do_not_parse(presented: str) -> None:
    assert parse_key(presented, TENANT_KEY) is None


def test_admin_tokens_and_tenant_keys_are_not_interchangeable() -> None:
    token = generate_key(ADMIN_TOKEN)
    assert parse_key(token.plaintext, ADMIN_TOKEN) == token.prefix
    assert parse_key(token.plaintext, TENANT_KEY) is None


def test_verify_rejects_a_changed_secret_and_an_unknown_prefix() -> None:
    key = generate_key()
    tampered = key.plaintext[:-1] + ("A" if key.plaintext[-1] != "A" else "B")
    assert verify_key(key.plaintext, key.secret_hash)
    assert not verify_key(tampered, key.secret_hash)
    assert not verify_key(key.plaintext, None)
