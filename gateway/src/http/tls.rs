//! TLS and mutual TLS on the gateway's listeners, HTTP and gRPC alike
//! (rustls, ring provider).
//!
//! `--tls-cert` (PEM chain, leaf first) and `--tls-key` (PEM private key:
//! PKCS#8, PKCS#1 or SEC1) turn TLS on; `--client-ca` (PEM, one or more CA
//! certificates) then **requires** a client certificate signed by one of
//! them: a client without one fails the handshake and never reaches HTTP.
//! Read once at start (a changed certificate needs a restart).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// The files of the listener's TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain, PEM.
    pub cert: PathBuf,
    /// Private key, PEM.
    pub key: PathBuf,
    /// CA certificates that client certificates must chain to; `None`: no
    /// client certificate asked for.
    pub client_ca: Option<PathBuf>,
}

fn certs(path: &Path, flag: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{flag} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{flag} {}: no PEM certificate", path.display()));
    }
    Ok(certs)
}

/// The application protocol a listener speaks, offered in ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// `--listen`: Envoy's callouts and the probes speak HTTP/1.1, or
    /// HTTP/2 (offered first).
    Http,
    /// `--grpc-listen`: gRPC is HTTP/2.
    H2,
}

/// The acceptor of [`TlsFiles`] offering `alpn`; the error names the flag and file.
pub fn acceptor(files: &TlsFiles, alpn: Alpn) -> Result<TlsAcceptor, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certs(&files.cert, "--tls-cert")?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| format!("--tls-key {}: {e}", files.key.display()))?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in certs(ca, "--client-ca")? {
                roots
                    .add(c)
                    .map_err(|e| format!("--client-ca {}: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("--client-ca {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| format!("--tls-cert/--tls-key: {e}"))?;
    config.alpn_protocols = match alpn {
        Alpn::Http => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        Alpn::H2 => vec![b"h2".to_vec()],
    };
    Ok(TlsAcceptor::from(Arc::new(config)))
}
