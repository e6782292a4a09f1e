//! `conclave certs init|issue`: a certificate authority and the certificates it signs, for
//! client TLS (`server`, `client`) and peer mutual TLS (`peer`). `conclave dev --tls` uses the
//! same functions for its throwaway CA.
//!
//! Files (PEM; keys are written readable by their owner only):
//! - `init DIR`: `DIR/ca.pem`, `DIR/ca-key.pem`.
//! - `issue --ca DIR --name N --kind K`: `OUT/N-K.pem`, `OUT/N-K-key.pem` (OUT defaults to DIR).
//!
//! What each kind carries:
//! - `server`: extended key usage serverAuth; subject alternative names from `--dns`/`--ip`,
//!   `localhost` and `127.0.0.1` when none are given.
//! - `peer`: serverAuth and clientAuth; the member name `N` as a DNS name (members check that a
//!   peer's certificate names the member it claims to be), plus `--dns`/`--ip`.
//! - `client`: clientAuth; the common name `N` (the user under common-name authentication).

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand, ValueEnum};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::cluster_spec::CliError;

/// Days a CA made by `certs init` is valid by default.
pub const CA_VALID_DAYS_DEFAULT: u32 = 3650;
/// Days a certificate made by `certs issue` is valid by default.
pub const CERT_VALID_DAYS_DEFAULT: u32 = 825;
/// The longest validity either accepts.
pub const VALID_DAYS_MAX: u32 = 36_500;

#[derive(Subcommand, Debug)]
pub enum CertsCommand {
    /// Create a certificate authority in DIR (ca.pem, ca-key.pem).
    Init(InitArgs),
    /// Issue a server, peer or client certificate signed by the CA in --ca.
    Issue(IssueArgs),
}

#[derive(Args, Debug)]
pub struct InitArgs {
    /// Directory for ca.pem and ca-key.pem (created if missing; existing files are kept).
    pub dir: PathBuf,
    /// The CA's common name.
    #[arg(long, default_value = "Conclave CA")]
    pub name: String,
    /// Days the CA is valid.
    #[arg(long, default_value_t = CA_VALID_DAYS_DEFAULT)]
    pub days: u32,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertKind {
    /// A member's client-port certificate (`--cert-file`).
    Server,
    /// A member's peer-port certificate (`--peer-cert-file`), naming the member.
    Peer,
    /// A client's certificate (`--cert`), for servers with `--client-cert-auth`.
    Client,
}

impl CertKind {
    fn as_str(self) -> &'static str {
        match self {
            CertKind::Server => "server",
            CertKind::Peer => "peer",
            CertKind::Client => "client",
        }
    }
}

#[derive(Args, Debug)]
pub struct IssueArgs {
    /// Directory holding ca.pem and ca-key.pem (from `certs init`).
    #[arg(long, value_name = "DIR")]
    pub ca: PathBuf,
    /// The certificate's common name; for `peer` the member's name (`--name` of serve).
    #[arg(long)]
    pub name: String,
    /// What the certificate is for.
    #[arg(long, value_enum)]
    pub kind: CertKind,
    /// An IP address the certificate is valid for (repeatable).
    #[arg(long = "ip", value_name = "IP")]
    pub ips: Vec<IpAddr>,
    /// A DNS name the certificate is valid for (repeatable).
    #[arg(long = "dns", value_name = "NAME")]
    pub dns: Vec<String>,
    /// Directory for the certificate and key (default: the CA's directory).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Days the certificate is valid.
    #[arg(long, default_value_t = CERT_VALID_DAYS_DEFAULT)]
    pub days: u32,
    /// End of validity as YYYY-MM-DD instead of --days (a date in the past makes an expired
    /// certificate, for testing that clients refuse one).
    #[arg(long, value_name = "DATE")]
    pub not_after: Option<String>,
}

fn io(what: &str, path: &Path, error: impl std::fmt::Display) -> CliError {
    CliError::Io(format!("cannot {what} {}: {error}", path.display()))
}

fn tls_error(error: rcgen::Error) -> CliError {
    CliError::Io(format!("cannot make the certificate: {error}"))
}

/// Writes `text` to a new file (mode `mode`), refusing to overwrite one.
fn write_new(path: &Path, text: &str, mode: u32) -> Result<(), CliError> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| io("create", path, e))?;
    file.write_all(text.as_bytes())
        .map_err(|e| io("write", path, e))
}

fn validity(days: u32) -> Result<(time::OffsetDateTime, time::OffsetDateTime), CliError> {
    if days == 0 || days > VALID_DAYS_MAX {
        return Err(CliError::Usage(format!(
            "--days must be between 1 and {VALID_DAYS_MAX}"
        )));
    }
    let now = time::OffsetDateTime::now_utc();
    // An hour of slack for clocks that lag this one.
    Ok((
        now - time::Duration::hours(1),
        now + time::Duration::days(i64::from(days)),
    ))
}

fn parse_date(text: &str) -> Result<time::OffsetDateTime, CliError> {
    let bad = || CliError::Usage(format!("--not-after {text:?} is not a date YYYY-MM-DD"));
    let mut parts = text.split('-');
    let (Some(y), Some(m), Some(d), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let year: i32 = y.parse().map_err(|_| bad())?;
    let month: u8 = m.parse().map_err(|_| bad())?;
    let day: u8 = d.parse().map_err(|_| bad())?;
    let month = time::Month::try_from(month).map_err(|_| bad())?;
    let date = time::Date::from_calendar_date(year, month, day).map_err(|_| bad())?;
    Ok(date.midnight().assume_utc())
}

/// The CA files of `dir`.
pub fn ca_paths(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("ca.pem"), dir.join("ca-key.pem"))
}

/// Creates a CA in `dir` unless it already holds one. Returns the path of `ca.pem`.
pub fn init_ca(dir: &Path, name: &str, days: u32) -> Result<PathBuf, CliError> {
    std::fs::create_dir_all(dir).map_err(|e| io("create", dir, e))?;
    let (cert_path, key_path) = ca_paths(dir);
    if cert_path.exists() || key_path.exists() {
        return Err(CliError::Usage(format!(
            "{} already holds a CA (ca.pem or ca-key.pem); remove them first or use another directory",
            dir.display()
        )));
    }
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_error)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (params.not_before, params.not_after) = validity(days)?;
    let key = KeyPair::generate().map_err(tls_error)?;
    let cert = params.self_signed(&key).map_err(tls_error)?;
    write_new(&key_path, &key.serialize_pem(), 0o600)?;
    write_new(&cert_path, &cert.pem(), 0o644)?;
    Ok(cert_path)
}

/// The certificate and key files `issue` writes.
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Issues a certificate of `kind` for `name`, signed by the CA in `ca_dir`, into `out`.
// One parameter per `certs issue` flag; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub fn issue(
    ca_dir: &Path,
    name: &str,
    kind: CertKind,
    ips: &[IpAddr],
    dns: &[String],
    out: &Path,
    not_after: Option<time::OffsetDateTime>,
    days: u32,
) -> Result<Issued, CliError> {
    if name.is_empty() || name.contains('/') {
        return Err(CliError::Usage(format!(
            "--name {name:?} must be a non-empty name without '/'"
        )));
    }
    let (ca_cert_path, ca_key_path) = ca_paths(ca_dir);
    let ca_cert =
        std::fs::read_to_string(&ca_cert_path).map_err(|e| io("read", &ca_cert_path, e))?;
    let ca_key = std::fs::read_to_string(&ca_key_path).map_err(|e| io("read", &ca_key_path, e))?;
    let ca_key = KeyPair::from_pem(&ca_key).map_err(tls_error)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_cert, ca_key).map_err(tls_error)?;

    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_error)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    let mut names: Vec<String> = dns.to_vec();
    let mut addresses: Vec<IpAddr> = ips.to_vec();
    match kind {
        CertKind::Server => {
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            if names.is_empty() && addresses.is_empty() {
                names.push("localhost".into());
                addresses.push(IpAddr::from([127, 0, 0, 1]));
            }
        }
        CertKind::Peer => {
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            names.insert(0, name.to_string());
        }
        CertKind::Client => {
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        }
    }
    for dns_name in names {
        let san = dns_name.clone().try_into().map_err(|_| {
            CliError::Usage(format!(
                "{dns_name:?} is not a DNS name a certificate can carry"
            ))
        })?;
        params.subject_alt_names.push(SanType::DnsName(san));
    }
    params
        .subject_alt_names
        .extend(addresses.into_iter().map(SanType::IpAddress));
    (params.not_before, params.not_after) = validity(days)?;
    if let Some(not_after) = not_after {
        params.not_after = not_after;
        params.not_before = params.not_before.min(not_after - time::Duration::days(1));
    }
    let key = KeyPair::generate().map_err(tls_error)?;
    let cert = params.signed_by(&key, &issuer).map_err(tls_error)?;
    std::fs::create_dir_all(out).map_err(|e| io("create", out, e))?;
    let stem = format!("{name}-{}", kind.as_str());
    let issued = Issued {
        cert: out.join(format!("{stem}.pem")),
        key: out.join(format!("{stem}-key.pem")),
    };
    if issued.cert.exists() || issued.key.exists() {
        return Err(CliError::Usage(format!(
            "{} or its key already exists; remove them first",
            issued.cert.display()
        )));
    }
    write_new(&issued.key, &key.serialize_pem(), 0o600)?;
    write_new(&issued.cert, &cert.pem(), 0o644)?;
    Ok(issued)
}

/// Runs `conclave certs ...`, printing the files it wrote.
pub fn run(command: CertsCommand) -> Result<(), CliError> {
    match command {
        CertsCommand::Init(args) => {
            let cert = init_ca(&args.dir, &args.name, args.days)?;
            println!("{}", cert.display());
            println!("{}", ca_paths(&args.dir).1.display());
        }
        CertsCommand::Issue(args) => {
            let not_after = args.not_after.as_deref().map(parse_date).transpose()?;
            let out = args.out.clone().unwrap_or_else(|| args.ca.clone());
            let issued = issue(
                &args.ca, &args.name, args.kind, &args.ips, &args.dns, &out, not_after, args.days,
            )?;
            println!("{}", issued.cert.display());
            println!("{}", issued.key.display());
        }
    }
    Ok(())
}
