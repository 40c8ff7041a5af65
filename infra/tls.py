"""TLS for `grpo serve`'s two servers: the certificate they present and what clients trust.

Basic auth sends a password with every request; off loopback that needs TLS, or anyone on the
network path reads it. `grpo serve --tls-cert C --tls-key K` serves both servers on https with
a team's certificate (its CA is then the clients' business: the standard variables
SSL_CERT_FILE and REQUESTS_CA_BUNDLE, which Prefect's client, MLflow's client, urllib and
OpenSSL all read). `--tls-self-signed` makes a certificate for trying it out, kept in the
state directory and reused while it names the same hosts and has more than a week left; the
clients of serve's own processes get a bundle of the usual public CAs plus it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from reward_fns.errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# the variables every client here reads for the CAs it trusts: OpenSSL (urllib, Prefect's
# httpx client and websockets via PREFECT_API_SSL_CERT_FILE's default) and requests (MLflow)
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
SELF_SIGNED_DAYS = 365


class TLSError(UserError, ValueError):
    """A certificate or key is missing or unreadable, TLS options conflict, or a non-loopback
    address would be served without TLS; the message names it."""


@dataclass(frozen=True)
class TLS:
    """What both servers present (cert, key) and the CA bundle serve's clients verify with:
    None when the caller's own CA variables (or the system's store) are to be used."""

    cert: Path
    key: Path
    ca_bundle: Path | None

    def client_env(self) -> dict[str, str]:
        return {v: str(self.ca_bundle) for v in CA_VARS} if self.ca_bundle else {}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def choose(
    host: str, private: Path, cert: str | None, key: str | None, self_signed: bool,
    insecure_http: bool,
) -> TLS | None:  # fmt: skip
    """The TLS settings of a serve on `host`, checked before anything starts.

    Args:
        host: the address both servers listen on.
        private: serve's private folder in the state directory (0700), where a self-signed
            certificate is kept.
        cert, key: a team's PEM certificate (chain) and its private key; given together.
        self_signed: make (or reuse) a self-signed certificate instead.
        insecure_http: allow plain HTTP on a non-loopback address.
    """
    if (cert is None) != (key is None):
        raise TLSError("--tls-cert and --tls-key go together: give both, or --tls-self-signed")
    if self_signed and cert is not None:
        raise TLSError("--tls-self-signed makes its own certificate: drop --tls-cert/--tls-key")
    if insecure_http and (self_signed or cert is not None):
        raise TLSError("--insecure-http and TLS options contradict each other: choose one")
    if cert is not None and key is not None:
        return TLS(_readable(cert, "--tls-cert"), _readable(key, "--tls-key"), None)
    if self_signed:
        return self_signed_tls(private / "tls", host)
    if not is_loopback(host) and not insecure_http:
        raise TLSError(
            f"GRPO_SERVE_HOST={host} is not loopback: the servers' passwords would cross the "
            "network in clear. Give --tls-cert/--tls-key (or --tls-self-signed to try it), "
            "or say --insecure-http"
        )
    return None


def _readable(path: str, flag: str) -> Path:
    p = Path(path).expanduser().resolve()
    try:
        text = p.read_text()
    except OSError as e:
        raise TLSError(f"{flag} {p}: cannot read it ({e.strerror})") from None
    if "-----BEGIN " not in text:
        raise TLSError(f"{flag} {p}: expected a PEM file (-----BEGIN ...)")
    return p


def self_signed_tls(folder: Path, host: str) -> TLS:
    """A self-signed certificate for `host` and loopback in `folder` (made, or reused while it
    names the same hosts and is valid for more than a week), and a client bundle of the
    public CAs plus it."""
    from cryptography import x509

    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    cert, key, bundle = folder / "cert.pem", folder / "key.pem", folder / "ca-bundle.pem"
    names = sorted({host, *LOOPBACK})
    if cert.exists() and key.exists():
        current = x509.load_pem_x509_certificate(cert.read_bytes())
        left = current.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
        if _names(current) == names and left > datetime.timedelta(days=7):
            _write_bundle(bundle, cert)
            return TLS(cert, key, bundle)
    _make(cert, key, names)
    _write_bundle(bundle, cert)
    return TLS(cert, key, bundle)


def _names(cert: object) -> list[str]:
    from cryptography import x509

    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value  # type: ignore[attr-defined]
    return sorted([*san.get_values_for_type(x509.DNSName),
                   *(str(a) for a in san.get_values_for_type(x509.IPAddress))])  # fmt: skip


def _make(cert: Path, key: Path, names: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private_key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "grpo serve (self-signed)")])
    alt: list[x509.GeneralName] = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    now = datetime.datetime.now(datetime.UTC)
    built = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(private_key, hashes.SHA256())
    )
    # the key is written 0600 from its first byte, then moved into place
    tmp = key.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))  # fmt: skip
    os.replace(tmp, key)
    cert.write_bytes(built.public_bytes(serialization.Encoding.PEM))


def _write_bundle(bundle: Path, cert: Path) -> None:
    """The public CAs (certifi's, which requests uses by default) and the self-signed
    certificate: clients that trust it still reach https sites signed by public CAs."""
    import certifi

    bundle.write_text(Path(certifi.where()).read_text() + "\n" + cert.read_text())
