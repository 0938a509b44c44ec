//! Which hosts `idemkit check` may send traffic to: loopback, and hosts the user
//! named explicitly. A check sends bursts of writes; pointing it somewhere by
//! accident must be impossible.

use std::net::IpAddr;

use anyhow::bail;
use reqwest::Url;

/// `Ok` for an `http` URL on a loopback host or on a host named in `allowed`.
pub(super) fn check(url: &Url, allowed: &[String]) -> anyhow::Result<()> {
    match url.scheme() {
        "http" => {}
        "https" => {
            bail!("`{url}`: https is not supported (this build carries no TLS stack); check over plain http")
        }
        other => bail!("`{url}`: unsupported scheme `{other}`, use http"),
    }
    let Some(host) = url.host_str() else {
        bail!("`{url}` has no host");
    };
    let name = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = match name.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => name.eq_ignore_ascii_case("localhost"),
    };
    let named = allowed.iter().any(|a| {
        a.trim()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .eq_ignore_ascii_case(name)
    });
    if !loopback && !named {
        bail!(
            "refusing to send check traffic to `{name}`: only loopback hosts are checked unless named with --allow-host {name}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(url: &str, allowed: &[&str]) -> bool {
        let allowed: Vec<String> = allowed.iter().map(|s| s.to_string()).collect();
        check(&Url::parse(url).unwrap(), &allowed).is_ok()
    }

    #[test]
    fn loopback_passes_and_everything_else_needs_a_name() {
        assert!(ok("http://127.0.0.1:3000/orders", &[]));
        assert!(ok("http://127.9.9.9/orders", &[]));
        assert!(ok("http://[::1]:3000/orders", &[]));
        assert!(ok("http://LOCALHOST:3000/orders", &[]));
        assert!(!ok("http://localhost.example.com/orders", &[]));
        assert!(!ok("http://192.168.1.10/orders", &[]));
        assert!(!ok("http://0.0.0.0:3000/orders", &[]));
        assert!(ok("http://192.168.1.10/orders", &["192.168.1.10"]));
        assert!(ok("http://[fd00::1]/orders", &["[fd00::1]"]));
        assert!(ok("http://Staging.Internal:80/x", &["staging.internal"]));
        assert!(!ok("http://staging.internal/x", &["other.internal"]));
        assert!(!ok("https://127.0.0.1/x", &[]));
        assert!(!ok("ftp://127.0.0.1/x", &[]));
    }
}
