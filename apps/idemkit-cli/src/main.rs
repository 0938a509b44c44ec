//! The `idemkit` binary: a thin shell around [`idemkit_cli::main`].

fn main() -> std::process::ExitCode {
    idemkit_cli::main()
}
