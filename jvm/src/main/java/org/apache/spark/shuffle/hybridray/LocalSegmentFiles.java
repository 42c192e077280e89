package org.apache.spark.shuffle.hybridray;

import com.fasterxml.jackson.databind.JsonNode;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.SeekableByteChannel;
import java.nio.file.Files;
import java.nio.file.InvalidPathException;
import java.nio.file.LinkOption;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardOpenOption;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

/**
 * Confinement of the disk-tier segment files a reader opens on its own node.
 *
 * <p>A segment's location comes from the shuffle master's metadata, i.e. from another
 * process. Before a reader opens it, the path must lie below hybrid_ray's data directory
 * ({@code <spill dir>/hybrid_ray}) of one of this node's configured spill dirs, both
 * resolved to real paths ({@code ..} and every symlink followed), so neither a {@code ..}
 * component nor a symlink anywhere on the way can make a reader open a file elsewhere.
 * A spill dir may itself be a symlink (as the Python disk tier allows); its real path is
 * then the root. The file is opened by its resolved path without following a final link.
 */
final class LocalSegmentFiles {
  /** The {@code {node_id}} placeholder of {@code ShuffleConfig.spill_dirs}. */
  static final String NODE_ID_PLACEHOLDER = "{node_id}";

  private LocalSegmentFiles() {}

  /** A segment location outside this node's spill dirs: never read, never a fetch failure. */
  static final class UnsafeSegmentPathException extends SecurityException {
    private static final long serialVersionUID = 1L;

    UnsafeSegmentPathException(String message) {
      super(message);
    }
  }

  /**
   * This node's spill dirs from the ShuffleConfig JSON that Spark's configuration carries
   * ({@code spark.hybridray.config}, field {@code spill_dirs}; {@code {node_id}} expanded).
   * Without that field the Python side uses its default spill dir, so that is returned.
   */
  static List<String> spillDirs(JsonNode config, String nodeId) {
    JsonNode dirs = config == null ? null : config.get("spill_dirs");
    if (dirs == null || !dirs.isArray() || dirs.isEmpty()) {
      return Collections.singletonList(defaultSpillDir());
    }
    List<String> out = new ArrayList<>(dirs.size());
    for (JsonNode d : dirs) {
      out.add(d.asText().replace(NODE_ID_PLACEHOLDER, nodeId));
    }
    return Collections.unmodifiableList(out);
  }

  /**
   * {@code hybrid_ray.config.default_spill_dir()}: {@code <temp dir>/hybrid_ray_spill_<uid>},
   * the temp dir found as Python's {@code tempfile.gettempdir()} looks first ($TMPDIR, $TEMP,
   * $TMP, then /tmp).
   */
  static String defaultSpillDir() {
    String tmp = "/tmp";
    for (String name : new String[] {"TMPDIR", "TEMP", "TMP"}) {
      String value = System.getenv(name);
      if (value != null && !value.isEmpty() && Files.isDirectory(Paths.get(value))) {
        tmp = value;
        break;
      }
    }
    return Paths.get(tmp, "hybrid_ray_spill_" + new com.sun.security.auth.module.UnixSystem()
        .getUid()).toString();
  }

  /**
   * The real path of segment file {@code location}, if it lies strictly below
   * {@code <spill dir>/hybrid_ray} of one of {@code spillDirs} (all resolved).
   *
   * @throws NoSuchFileException the file (or a directory on its way) does not exist: the
   *     segment is gone, a fetch failure
   * @throws UnsafeSegmentPathException the path is not absolute, or resolves outside every
   *     allowed directory; the message names the path and the allowed directories
   */
  static Path requireInside(String location, List<String> spillDirs) throws IOException {
    List<String> allowed = new ArrayList<>(spillDirs.size());
    for (String d : spillDirs) {
      allowed.add(Paths.get(d, RaySegmentSink.DATA_DIR_NAME).toString());
    }
    Path path;
    try {
      path = Paths.get(location);
    } catch (InvalidPathException e) {
      throw refused(location, allowed, "it is not a valid path");
    }
    if (!path.isAbsolute()) {
      throw refused(location, allowed, "it is not an absolute path");
    }
    // Lexically first: a '..' escape is refused even where its target does not exist.
    Path normal = path.normalize();
    boolean lexicallyInside = false;
    for (String root : allowed) {
      Path r = Paths.get(root).normalize();
      if (!normal.equals(r) && normal.startsWith(r)) {
        lexicallyInside = true;
        break;
      }
    }
    if (!lexicallyInside) {
      throw refused(location, allowed, "it is not below any allowed directory");
    }
    Path real = path.toRealPath();  // NoSuchFileException: the segment is gone
    for (String root : allowed) {
      Path r;
      try {
        r = Paths.get(root).toRealPath();
      } catch (NoSuchFileException e) {
        continue;  // this spill dir holds no data here
      }
      if (!real.equals(r) && real.startsWith(r)) {
        if (!Files.isRegularFile(real, LinkOption.NOFOLLOW_LINKS)) {
          throw refused(location, allowed, "it is not a regular file");
        }
        return real;
      }
    }
    throw refused(location, allowed, "it resolves to " + real + " (through a symlink)");
  }

  /**
   * The bytes of segment file {@code location} after {@link #requireInside}; the resolved
   * path is opened without following a link in its last component.
   */
  static byte[] read(String location, List<String> spillDirs) throws IOException {
    Path real = requireInside(location, spillDirs);
    try (SeekableByteChannel ch = Files.newByteChannel(real, StandardOpenOption.READ,
        LinkOption.NOFOLLOW_LINKS)) {
      long size = ch.size();
      if (size > Integer.MAX_VALUE - 16) {
        throw new IOException("segment file " + location + " is too large (" + size + " bytes)");
      }
      ByteBuffer buf = ByteBuffer.allocate((int) size);
      while (buf.hasRemaining() && ch.read(buf) >= 0) {
        // read to the end
      }
      if (buf.hasRemaining()) {
        throw new IOException("segment file " + location + " shrank while being read");
      }
      return buf.array();
    }
  }

  private static UnsafeSegmentPathException refused(String location, List<String> allowed,
      String why) {
    return new UnsafeSegmentPathException("hybrid_ray: refusing to read disk segment file '"
        + location + "': " + why + "; a reader only opens files inside this node's spill "
        + "dirs' data directories " + allowed + " (the location came from the shuffle "
        + "master's metadata; this is a bug or tampering, please report it)");
  }
}
