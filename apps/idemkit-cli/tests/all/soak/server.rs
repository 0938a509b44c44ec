//! A PostgreSQL server of the soak's own: `initdb` into a temporary
//! directory, `pg_ctl` on a free port, so that the chaos can restart it for
//! real (an immediate shutdown: what a crash of the server does, with crash
//! recovery on the way up) without touching the server the other tests
//! share. Run as the `postgres` user when the tests run as root (`initdb`
//! refuses root).

use std::path::PathBuf;
use std::process::Command;

use crate::labels::free_port;

pub(crate) struct PgServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

/// The directory of `initdb` and `pg_ctl`: `pg_config --bindir`, else the
/// newest `/usr/lib/postgresql/*/bin` (Debian's layout).
fn bindir() -> Option<PathBuf> {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return Some(dir);
        }
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin)
}

impl PgServer {
    /// Creates and starts a server; `None` when no PostgreSQL binaries are
    /// installed.
    pub(crate) fn start() -> Option<Self> {
        let bin = bindir()?;
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        let dir = std::env::temp_dir().join(format!(
            "idemkit-soak-pg-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_micros()
        ));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let server = Self {
            bin,
            dir,
            port: free_port(),
            as_postgres,
        };
        if as_postgres {
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&server.dir)
                .status()
                .expect("chown");
            assert!(status.success(), "chown of {} to postgres", server.dir.display());
        }
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        server.pg_ctl("start");
        Some(server)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// One of the server's tools, run as `postgres` when we are root.
    fn command(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(exe);
            cmd
        } else {
            Command::new(exe)
        }
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = self
            .command(tool)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} {args:?}: {}\n{}\nlog: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.log()).unwrap_or_default()
        );
    }

    fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// `pg_ctl ACTION` with an immediate shutdown and a wait for the server
    /// to accept connections again (`-w`).
    fn pg_ctl(&self, action: &str) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let data = self.data();
        let log = self.log();
        self.run(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "-t",
                "60",
                "-o",
                &options,
                action,
            ],
        );
    }

    /// The URL of database `name` on this server.
    pub(crate) fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Stops the server at once (every backend killed, nothing flushed
    /// beyond what the WAL holds) and starts it again, waiting until it
    /// accepts connections: its clients see every connection fail, then a
    /// server that ran crash recovery.
    pub(crate) fn restart(&self) {
        self.pg_ctl("restart");
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self
            .command("pg_ctl")
            .args(["-D", data.to_str().unwrap(), "-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
