"""Mutual TLS: with cluster.tls set, a client without a certificate signed by the job's CA is refused.

A throwaway CA signs one certificate (SAN 127.0.0.1 / localhost) used by a real
PS process and a good client; clients with no certificate, with a certificate
from another CA, or with no TLS at all cannot complete an RPC.
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from hybridrec.core.runtime import rpc
from hybridrec.core.config import TLSConfig
from tests.faults.ps_process import lookup_status, ps_process

pytestmark = pytest.mark.faults


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, issuer_key, issuer_name, *, ca: bool):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name or _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(dir_: Path, name: str, key, cert) -> tuple[Path, Path]:
    key_path, cert_path = dir_ / f"{name}.key", dir_ / f"{name}.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture
def pki(tmp_path):
    ca_key, ca_cert = _issue("hybridrec test CA", None, None, ca=True)
    _write(tmp_path, "ca", ca_key, ca_cert)
    svc_key, svc_cert = _issue("hybridrec", ca_key, ca_cert.subject, ca=False)
    _write(tmp_path, "service", svc_key, svc_cert)
    rogue_ca_key, rogue_ca_cert = _issue("rogue CA", None, None, ca=True)
    rogue_key, rogue_cert = _issue("hybridrec", rogue_ca_key, rogue_ca_cert.subject, ca=False)
    _write(tmp_path, "rogue", rogue_key, rogue_cert)
    return tmp_path


def test_client_without_valid_certificate_is_refused(tmp_path, pki):
    tls = {"ca": str(pki / "ca.pem"), "cert": str(pki / "service.pem"), "key": str(pki / "service.key")}
    with ps_process(tmp_path, tls=tls) as (address, _):
        async def scenario() -> dict[str, grpc.StatusCode]:
            rpc.use_tls(TLSConfig(**tls))
            await rpc.wait_until_serving([address], timeout_s=120)
            results = {}
            async with rpc.channel(address) as ch:
                results["valid certificate"] = await lookup_status(ch)
            ca = (pki / "ca.pem").read_bytes()
            async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:
                results["no client certificate"] = await lookup_status(ch)
            rogue = grpc.ssl_channel_credentials(root_certificates=ca, private_key=(pki / "rogue.key").read_bytes(),
                                                 certificate_chain=(pki / "rogue.pem").read_bytes())
            async with grpc.aio.secure_channel(address, rogue) as ch:
                results["certificate from another CA"] = await lookup_status(ch)
            async with grpc.aio.insecure_channel(address) as ch:
                results["plaintext"] = await lookup_status(ch)
            rpc.use_tls(None)
            return results

        results = asyncio.run(scenario())
    assert results.pop("valid certificate") == grpc.StatusCode.OK
    assert all(code == grpc.StatusCode.UNAVAILABLE for code in results.values()), results
