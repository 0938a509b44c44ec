//! A PostgreSQL server of a test's own: `initdb` into a temporary directory,
//! `pg_ctl` on a free port, so a test can stop it the way a crash of the
//! server does (an immediate shutdown: every backend killed, crash recovery on
//! the way up) without touching the server the other tests share. The
//! server's tools run as the `postgres` user when the tests run as root
//! (`initdb` refuses root).

use std::path::PathBuf;
use std::process::Command;

/// A throwaway PostgreSQL server, stopped and deleted on drop.
#[derive(Debug)]
pub struct PgServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    settings: String,
    as_postgres: bool,
}

/// A free loopback TCP port (bound, read and released: another process may
/// take it before the caller binds it, which is a test's accepted risk).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// The directory of `initdb` and `pg_ctl`: `pg_config --bindir`, else the
/// newest `/usr/lib/postgresql/*/bin` (Debian's layout); `None` when the
/// server's binaries are not installed.
pub fn pg_bindir() -> Option<PathBuf> {
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
    /// Creates a server (`initdb`) and starts it, with each of `settings`
    /// passed as a `-c` option (for example `fsync=off`); `None` when no
    /// PostgreSQL server binaries are installed. Panics, with the server's
    /// log, when `initdb` or the start fails.
    pub fn start(settings: &[&str]) -> Option<Self> {
        let bin = pg_bindir()?;
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        let dir = std::env::temp_dir().join(format!(
            "idemkit-pg-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("a clock after 1970")
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let mut server = Self {
            bin,
            dir,
            port: free_port(),
            settings: String::new(),
            as_postgres,
        };
        server.settings = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=200{}",
            server.port,
            server.dir.display(),
            settings.iter().map(|s| format!(" -c {s}")).collect::<String>()
        );
        if as_postgres {
            let status = Command::new("chown")
                .arg("postgres:postgres")
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
                path(&data),
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

    fn log(&self) -> PathBuf {
        self.dir.join("server.log")
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

    /// `pg_ctl ACTION` with an immediate shutdown and, for a start, a wait
    /// until the server accepts connections (`-w`).
    fn pg_ctl(&self, action: &str) {
        let (data, log) = (self.data(), self.log());
        self.run(
            "pg_ctl",
            &[
                "-D",
                path(&data),
                "-l",
                path(&log),
                "-m",
                "immediate",
                "-w",
                "-t",
                "60",
                "-o",
                &self.settings,
                action,
            ],
        );
    }

    /// The URL of database `name` on this server (`postgres` always exists).
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Stops the server at once, as a crash of it would: every backend is
    /// killed and nothing is flushed beyond what the WAL holds.
    pub fn crash(&self) {
        self.pg_ctl("stop");
    }

    /// Starts a crashed server again (crash recovery runs) and waits until it
    /// accepts connections.
    pub fn start_again(&self) {
        self.pg_ctl("start");
    }

    /// [`PgServer::crash`] then [`PgServer::start_again`] in one step: the
    /// server's clients see every connection fail, then a server that ran
    /// crash recovery.
    pub fn restart(&self) {
        self.pg_ctl("restart");
    }
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("a UTF-8 temporary path")
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self
            .command("pg_ctl")
            .args(["-D", path(&data), "-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
