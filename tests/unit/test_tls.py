"""serve's TLS choices, checked before anything starts; the self-signed certificate."""

from __future__ import annotations

import ssl

import pytest
from cryptography import x509

from infra.tls import TLSError, choose, is_loopback


def test_a_non_loopback_address_needs_tls_or_says_insecure_http(tmp_path):
    assert choose("127.0.0.1", tmp_path, None, None, False, False) is None
    assert choose("localhost", tmp_path, None, None, False, False) is None
    assert choose("10.1.2.3", tmp_path, None, None, False, True) is None
    with pytest.raises(TLSError, match="GRPO_SERVE_HOST=10.1.2.3 is not loopback"):
        choose("10.1.2.3", tmp_path, None, None, False, False)
    assert [is_loopback(h) for h in ("::1", "127.0.0.2", "0.0.0.0", "node-a")] == [
        True, True, False, False]  # fmt: skip


@pytest.mark.parametrize(
    ("cert", "key", "self_signed", "insecure", "said"),
    [
        ("c.pem", None, False, False, "--tls-cert and --tls-key go together"),
        ("c.pem", "k.pem", True, False, "--tls-self-signed makes its own"),
        (None, None, True, True, "--insecure-http and TLS options contradict"),
        ("missing.pem", "k.pem", False, False, r"--tls-cert .*missing.pem: cannot read it"),
        ("k.pem", "notpem.txt", False, False, r"--tls-key .*notpem.txt: expected a PEM file"),
    ],
)  # fmt: skip
def test_conflicting_or_unreadable_tls_options_are_refused(
    tmp_path, cert, key, self_signed, insecure, said
):
    (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "k.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (tmp_path / "notpem.txt").write_text("hello\n")
    path = {None: None} | {n: str(tmp_path / n) for n in ("c.pem", "k.pem", "notpem.txt",
                                                        "missing.pem")}  # fmt: skip
    with pytest.raises(TLSError, match=said):
        choose("127.0.0.1", tmp_path, path[cert], path[key], self_signed, insecure)


def test_the_self_signed_certificate_names_the_host_and_loopback_and_is_reused(tmp_path):
    tls = choose("10.1.2.3", tmp_path, None, None, True, False)
    cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {
        "10.1.2.3", "127.0.0.1", "::1"}  # fmt: skip
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert tls.key.stat().st_mode & 0o077 == 0
    # the bundle holds the public CAs and this certificate: a context built on it loads both
    ctx = ssl.create_default_context(cafile=str(tls.ca_bundle))
    assert len(ctx.get_ca_certs()) > 100
    assert tls.client_env() == {"SSL_CERT_FILE": str(tls.ca_bundle),
                                "REQUESTS_CA_BUNDLE": str(tls.ca_bundle)}  # fmt: skip
    made = tls.cert.read_bytes()
    assert choose("10.1.2.3", tmp_path, None, None, True, False).cert.read_bytes() == made
    # another host: a new certificate
    assert choose("10.9.9.9", tmp_path, None, None, True, False).cert.read_bytes() != made
