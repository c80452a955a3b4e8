//! Certificates made by a test: a CA, a server certificate for loopback
//! names, a client certificate, written as PEM files into a temporary
//! directory (rcgen, ECDSA P-256). A second [`TestPki`] is a CA the first
//! one's certificates do not chain to ("the wrong CA").

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// PEM files of one test CA and the certificates it signed; removed on drop.
#[derive(Debug)]
pub struct TestPki {
    dir: tempfile::TempDir,
}

impl TestPki {
    /// A new CA, a server certificate for `server_names` (DNS names or IP
    /// addresses, e.g. `["127.0.0.1", "localhost"]`) and a client
    /// certificate (CN `testkit-client`).
    pub fn new(server_names: &[&str]) -> Result<TestPki> {
        let dir = tempfile::Builder::new().prefix("testkit-pki-").tempdir()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "testkit CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
        let write = |name: &str, pem: String| -> Result<()> {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).with_context(|| format!("writing {}", path.display()))
        };
        write("ca.pem", ca.pem())?;

        let names: Vec<String> = server_names.iter().map(|s| s.to_string()).collect();
        let mut server = CertificateParams::new(names)?;
        server
            .distinguished_name
            .push(DnType::CommonName, "testkit server");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate()?;
        write("server.pem", server.signed_by(&server_key, &ca)?.pem())?;
        write("server-key.pem", server_key.serialize_pem())?;

        let mut client = CertificateParams::new(Vec::<String>::new())?;
        client
            .distinguished_name
            .push(DnType::CommonName, "testkit-client");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate()?;
        write("client.pem", client.signed_by(&client_key, &ca)?.pem())?;
        write("client-key.pem", client_key.serialize_pem())?;
        Ok(TestPki { dir })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The CA certificate.
    pub fn ca(&self) -> PathBuf {
        self.file("ca.pem")
    }

    /// The server certificate.
    pub fn server_cert(&self) -> PathBuf {
        self.file("server.pem")
    }

    /// The server's private key.
    pub fn server_key(&self) -> PathBuf {
        self.file("server-key.pem")
    }

    /// The client certificate.
    pub fn client_cert(&self) -> PathBuf {
        self.file("client.pem")
    }

    /// The client's private key.
    pub fn client_key(&self) -> PathBuf {
        self.file("client-key.pem")
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
