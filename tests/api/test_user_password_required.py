"""A new user without a password is refused in the user's terms, never a 500 (Schemathesis
found `password=` in a form body reaching create_user() without it)."""

import pytest

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("body", "fmt"),
    [({"username": "nopass"}, "json"), ({"username": "nopass", "password": ""}, "multipart")],
)
def test_a_new_user_without_a_password_is_a_400_naming_it(client_for, root, body, fmt) -> None:
    answer = client_for(root).post("/api/v1/users/", body, format=fmt)
    assert answer.status_code == 400, answer.content
    assert "password" in answer.content.decode()
